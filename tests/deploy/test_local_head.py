"""`ensure_local_head`, on real `ray start` processes (through `service.backends.ray_start`): a head that never becomes
ready is stopped, whole, and started again on fresh ports before the error reaches the caller; one that comes up is
re-attached to, not started twice."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from service.backends import ray_local
from service.backends.ray_local import _temp_dir_for, ensure_local_head, head_processes, stop_local_head
from service.backends.ray_start import LAUNCHER
from service.core.errors import InfraError
from tests.conftest import wait_for


def test_a_head_that_never_answers_is_stopped_and_tried_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The probe says "not ready" whatever Ray does: each try must stop what `ray start` left running.
    dashboards: list[str] = []

    def never(url: str, timeout: float = 2.0) -> bool:
        dashboards.append(url)
        return False

    monkeypatch.setattr(ray_local, "dashboard_answers", never)
    data_dir = tmp_path / "head"
    with pytest.raises(InfraError, match="did not answer within 1 s; its log ends"):
        ensure_local_head(data_dir, num_cpus=1, num_gpus=0, ready_seconds=1.0)
    assert len(set(dashboards)) == 2, "the second try must use fresh ports"
    assert head_processes(_temp_dir_for(data_dir)) == [], "a head that never answered was left running"
    assert not (data_dir / ray_local.STATE_FILE).exists()


def test_a_ready_head_is_reattached_not_started_again(tmp_path: Path) -> None:
    data_dir = tmp_path / "head"
    try:
        head = ensure_local_head(data_dir, num_cpus=1, num_gpus=0)
        core = _core(head.temp_dir)
        assert sorted(core.values()) == ["gcs_server", "raylet"]
        again = ensure_local_head(data_dir, num_cpus=1, num_gpus=0)
        assert again == head and _core(head.temp_dir) == core
        # The processes that no longer name the temp dir are the head's too: the raylet's agents (retitled
        # `ray::DashboardAgent`) and the Ray Client server (it names the GCS's port only).
        agent = lambda: any(n.startswith("ray::DashboardAgent") for n in _named(head.temp_dir).values())  # noqa: E731
        wait_for(agent, what="the raylet's dashboard agent")
        everything = head_processes(head.temp_dir)
        assert any("ray.util.client.server" in " ".join(_cmdline(pid)) for pid in everything)
        # Its workers start through shunter's launcher (service.backends.ray_start), and a task's runtime env still
        # reaches the task: a real Ray worker, started by the raylet, ran it.
        raylet = next(pid for pid, name in core.items() if name == "raylet")
        assert LAUNCHER in " ".join(_cmdline(raylet))
        task = (
            "import os, ray; ray.init(address=os.environ['A'], runtime_env={'env_vars': {'T': 'x${HOME}'}});"
            "print(ray.get(ray.remote(lambda: os.environ['T']).remote()))"
        )
        ran = subprocess.run([sys.executable, "-c", task], env={**os.environ, "A": head.gcs_address},
                             capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
        assert ran.stdout.strip().endswith(f"x{os.environ['HOME']}"), ran.stdout[-1000:] + ran.stderr[-2000:]
    finally:
        stop_local_head(data_dir)
    assert head_processes(_temp_dir_for(data_dir)) == []
    assert not [pid for pid in everything if _alive(pid)], "a process of the stopped head is still running"


def _named(temp_dir: str) -> dict[int, str]:
    out = {}
    for pid in head_processes(temp_dir):
        with contextlib.suppress(psutil.Error):
            out[pid] = psutil.Process(pid).name() + " " + " ".join(psutil.Process(pid).cmdline())
    return out


def _core(temp_dir: str) -> dict[int, str]:
    """The head's GCS and raylet (its workers come and go)."""
    names = {pid: name.split()[0] for pid, name in _named(temp_dir).items()}
    return {pid: name for pid, name in names.items() if name in ("gcs_server", "raylet")}


def _cmdline(pid: int) -> list[str]:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).cmdline()
    return []


def _alive(pid: int) -> bool:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    return False


def test_ports_a_head_is_told_to_take_lie_outside_the_range_the_kernel_hands_out() -> None:
    """A port picked free inside the kernel's ephemeral range can be handed to another socket (a raylet's gRPC server
    binding port 0, any outgoing connection) before Ray binds it: a test cluster's head once lost its dashboard agent's
    port so, and answered every submission "No available agent". `free_port` picks below that range, and above Ray's
    worker ports, a port free on every address."""
    import socket

    from service.backends import ray_local

    low = ray_local._ephemeral_low()
    picks = [ray_local.free_port() for _ in range(200)]
    assert all(ray_local.PICK_LOW <= p < low for p in picks), picks
    assert len(set(picks)) > 150  # spread over the range, not one port again and again
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", picks[0]))
        assert not ray_local._port_free(picks[0], "0.0.0.0") and not ray_local._port_free(picks[0])
