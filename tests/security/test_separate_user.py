"""The deployment layout of compose and KubeRay, on one machine: the Ray cluster runs as a separate, unprivileged Unix
user; the service (API + dispatcher, SQLite in a directory only it can read, tokens and cloud keys in its own
environment) runs as root. A job there finds no way to the database or the tokens: not in its environment, not in
any process's environment it can read, not in the database file, not through the API.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from service.backends.ray_local import LocalHead, dashboard_answers, free_port
from tests.security.probe import result_of
from tests.security.test_hostile_tenant import MARKER, SERVICE_SECRETS, TOKENS, wait_end
from tests.service.conftest import Service, service_env

pytestmark = pytest.mark.slow
RAY_USER = "shunter-ray"
REPO = Path(__file__).resolve().parents[2]
MALLORY, ALICE = (
    next(t for t, i in TOKENS.items() if i["owner"] == "mallory"),
    next(t for t, i in TOKENS.items() if i["owner"] == "alice"),
)


def _as_ray_user(args: list[str], env: dict[str, str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    env_args = [f"{k}={v}" for k, v in env.items()]
    return subprocess.run(["runuser", "-u", RAY_USER, "--", "env", "-i", *env_args, *args], text=True,
                          capture_output=True, **kwargs)  # type: ignore[call-overload]  # fmt: skip


@dataclass
class RayAsOtherUser:
    head: LocalHead
    temp_dir: Path
    storage: Path
    env: dict[str, str]


@pytest.fixture
def ray_as_other_user() -> Iterator[RayAsOtherUser]:
    if os.geteuid() != 0 or not shutil.which("runuser") or not shutil.which("useradd"):
        pytest.skip("needs root, runuser and useradd (CI runs as root)")
    try:
        pwd.getpwnam(RAY_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", RAY_USER],
                       check=True)  # fmt: skip
    # The interpreter may live under a home directory others cannot enter (pyenv in /root): let others traverse (not
    # list) each such directory for the length of the test, as an image built for this layout would have it.
    opened = [d for p in {Path(sys.base_prefix), REPO} for d in (p, *p.parents) if not d.stat().st_mode & 0o001]
    for d in opened:
        d.chmod(d.stat().st_mode | 0o001)
    base = Path(tempfile.mkdtemp(prefix="shr-", dir="/tmp"))  # short: Ray's socket paths must stay < 108 bytes
    home, temp_dir, storage = base / "home", base / "ray", base / "storage"
    for d in (home, temp_dir, storage):
        d.mkdir()
    base.chmod(0o755)
    shutil.chown(home, RAY_USER)
    shutil.chown(temp_dir, RAY_USER)
    shutil.chown(storage, RAY_USER)
    try:
        yield from _start(base, home, temp_dir, storage)
    finally:
        for d in opened:
            d.chmod(d.stat().st_mode & ~0o001)


def _start(base: Path, home: Path, temp_dir: Path, storage: Path) -> Iterator[RayAsOtherUser]:
    bin_dir = str(Path(sys.executable).parent)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(home), "PYTHONPATH": str(REPO), "LANG": "C.UTF-8",
           "RAY_USAGE_STATS_ENABLED": "0", "RAY_JOB_STOP_SIGNAL": "SIGINT", "OMP_NUM_THREADS": "1",
           "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25"}  # fmt: skip
    check = _as_ray_user([sys.executable, "-c", "import ray, torch, examples.mlp, tests.security.probe"], env,
                         cwd=str(home), timeout=120)  # fmt: skip
    if check.returncode != 0:  # a permissions regression of the checkout, the venv or the layout: a failure
        pytest.fail(f"{RAY_USER} cannot import the checkout at {REPO}: {check.stderr[-300:]}")
    port, dport = free_port(), free_port()
    started = _as_ray_user(
        [f"{bin_dir}/ray", "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
         "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dport}",
         f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
         f"--temp-dir={temp_dir}", "--num-cpus=3", "--disable-usage-stats"],
        env, cwd=str(home), timeout=180,
    )  # fmt: skip
    assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
    try:
        head = LocalHead(gcs_address=f"127.0.0.1:{port}", dashboard_url=f"http://127.0.0.1:{dport}",
                         temp_dir=str(temp_dir))  # fmt: skip
        deadline = time.monotonic() + 60
        while not dashboard_answers(head.dashboard_url) and time.monotonic() < deadline:
            time.sleep(0.5)
        yield RayAsOtherUser(head, temp_dir, storage, env)
    finally:
        _as_ray_user([f"{bin_dir}/ray", "stop", "--force"], env, cwd=str(home), timeout=120)
        subprocess.run(["pkill", "-KILL", "-u", RAY_USER], check=False)
        shutil.rmtree(base, ignore_errors=True)


def test_a_job_on_a_cluster_of_another_user_finds_no_way_to_the_database_or_the_tokens(
    tmp_path: Path, ray_as_other_user: RayAsOtherUser
) -> None:
    data = tmp_path / "service"  # under pytest's root-only temp dir, and 0700 itself
    data.mkdir(mode=0o700)
    port = free_port()
    env = service_env(data, ray_as_other_user.head, port, **SERVICE_SECRETS,
                      SHUNTER_STORAGE_URI=str(ray_as_other_user.storage))  # fmt: skip
    svc = Service(data_dir=data, port=port, env=env).start()
    try:
        alice = httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {ALICE}"}, timeout=30)
        mallory = httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {MALLORY}"}, timeout=30)
        work = {"entrypoint": {"callable": "examples.mlp:train_loop"}, "resources": {"num_workers": 1},
                "config": {"total_steps": 20, "checkpoint_every": 10}}  # fmt: skip
        victim = alice.post("/v1/jobs", json=work).json()["id"]
        db_file = data / "shunter.db"
        serve_environ = f"/proc/{svc.proc.pid}/environ" if svc.proc else ""
        probe = mallory.post("/v1/jobs", json={
            "entrypoint": {"callable": "tests.security.probe:train_loop"},
            "config": {"victim": victim, "marker": MARKER, "read": [str(db_file), serve_environ]},
        }).json()["id"]  # fmt: skip
        done = wait_end(mallory, probe, timeout=300)
        assert done["state"] == "SUCCEEDED", done
        found = result_of(mallory.get(f"/v1/jobs/{probe}/logs").text)
        assert found["user"] == RAY_USER  # the train loop ran as the Ray user, not as the service's
        assert found["env_with_secret"] == []
        assert found["proc_environ_with_secret"] == [], "a process environment holding a secret was readable"
        assert found["files"][str(db_file)] == "<PermissionError>"
        assert found["files"][serve_environ] == "<PermissionError>"
        assert found["write_victim_progress"] == 403 and found["read_victim_spec"] == 403
        assert found["user_api_with_attempt_token"] == 401 and found["user_api_without_token"] == 401
        # The layout works for everyone else: alice's job checkpointed (as the Ray user) and succeeded.
        finished = wait_end(alice, victim, timeout=300)
        assert (finished["state"], finished["step"]) == ("SUCCEEDED", 20), finished
        assert [c["complete"] for c in alice.get(f"/v1/jobs/{victim}/checkpoints").json()] == [True, True]
        owner = pwd.getpwuid(Path(finished["latest_checkpoint"]).stat().st_uid).pw_name
        assert owner == RAY_USER
        print(json.dumps({k: v for k, v in found.items() if k != "env"})[:2000])
    finally:
        if svc.proc is not None:
            svc.proc.send_signal(signal.SIGTERM)
        svc.stop()
