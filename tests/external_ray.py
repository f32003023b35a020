"""A Ray cluster outside the service, made of `ray start --block` processes that a test can kill and start again:
a head (optionally with GCS fault tolerance, its state in the machine's Redis) and worker nodes.

Each node runs in its own process group with its own temp dir (a worker node also in its own PID namespace), so a
kill takes one node and nothing else, the way a lost pod or machine does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Any

from service.backends.ray_local import RAY_START, dashboard_answers, free_port, head_environment, head_processes
from tests.conftest import wait_for

REPO = Path(__file__).resolve().parents[1]
REDIS = ("127.0.0.1", 6379)


def redis_answers() -> bool:
    try:
        with socket.create_connection(REDIS, timeout=2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class _Node:
    def __init__(self, prefix: str) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix=prefix, dir="/tmp")  # short: Ray's socket paths < 108 bytes
        self.proc: subprocess.Popen[bytes] | None = None

    def _spawn(self, cmd: list[str], env: dict[str, str]) -> None:
        log = open(Path(self.temp_dir) / "node.log", "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def kill(self) -> None:
        """As a node dies: SIGKILL to every process it started (job drivers too, which Ray starts in sessions of their
        own), no clean shutdown."""
        if self.proc is not None:
            import psutil

            with contextlib.suppress(psutil.NoSuchProcess):
                for child in psutil.Process(self.proc.pid).children(recursive=True):
                    with contextlib.suppress(psutil.NoSuchProcess):
                        child.kill()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
            self.proc = None
        for pid in head_processes(self.temp_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not head_processes(self.temp_dir), timeout=30, what="the node's processes to end")


STARTED = "This command will now block forever"  # what `ray start --block` says once its node runs


class ExternalHead(_Node):
    """A `ray start --head --block` at fixed ports. With `fault_tolerant`, its GCS keeps the cluster's state in Redis
    (a namespace of its own): a head started again after a kill is the same cluster, with the same jobs."""

    def __init__(self, *, num_cpus: int = 3, fault_tolerant: bool = False) -> None:
        super().__init__("shrh-")
        self.port, self.dashboard_port = free_port(), free_port()
        self.client_port, self.agent_port = free_port(), free_port()
        self.num_cpus = num_cpus
        self.namespace = f"shunter-test-{uuid.uuid4().hex[:12]}" if fault_tolerant else None

    @property
    def gcs_address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def environment(self) -> dict[str, str]:
        env = head_environment(str(REPO))
        if self.namespace is not None:
            env.update(RAY_REDIS_ADDRESS=f"{REDIS[0]}:{REDIS[1]}", RAY_external_storage_namespace=self.namespace)
        return env

    def start(self, tries: int = 3) -> None:
        """Start the head and wait until `ray start` says it runs and the dashboard answers. A start that fails is
        cleared away and made again at the same ports, `tries` times in all, as
        `service.backends.ray_local.ensure_local_head` does for shunter's own head: Ray 2.60's raylet gives its
        dashboard agent a fixed 15 s to write its ports and aborts past it, which an agent importing on a loaded 2-core
        machine can miss (a slow-tier run saw the chaos run's restarted head die so, and the run then waited out its
        whole timeout on a head that was not there)."""
        for attempt in range(1, tries + 1):
            # A new head machine or pod has no record of the last cluster on its disk. (Here other nodes' processes
            # name this address on their command lines, which `ray start` would take for a head still running.)
            Path(self.temp_dir, "ray_current_cluster").unlink(missing_ok=True)
            log = Path(self.temp_dir) / "node.log"
            said = log.read_text(errors="replace").count(STARTED) if log.exists() else 0
            self._spawn([
                *RAY_START, "--head", "--block", "--node-ip-address=127.0.0.1",
                f"--port={self.port}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                f"--dashboard-port={self.dashboard_port}", f"--ray-client-server-port={self.client_port}",
                f"--dashboard-agent-listen-port={self.agent_port}", f"--temp-dir={self.temp_dir}",
                f"--num-cpus={self.num_cpus}", "--disable-usage-stats",
            ], self.environment())  # fmt: skip
            proc = self.proc
            assert proc is not None
            wait_for(
                lambda p=proc, n=said: self._up_or_gone(p, n), timeout=180, what="`ray start --head` to start or end"
            )
            if proc.poll() is None:
                return
            tail = log.read_text(errors="replace")[-1500:]
            self.kill()
            if attempt == tries:
                raise AssertionError(f"the Ray head did not start in {tries} tries; the last ended:\n{tail}")

    def _up_or_gone(self, proc: subprocess.Popen[bytes], said: int) -> bool:
        """`ray start` ended (the start failed), or said its node runs and the dashboard answers."""
        if proc.poll() is not None:
            return True
        log = Path(self.temp_dir) / "node.log"
        return log.read_text(errors="replace").count(STARTED) > said and dashboard_answers(self.dashboard_url)

    def forget(self) -> None:
        """Delete the cluster's state from Redis (fault-tolerant heads), once every node is gone."""
        if self.namespace is not None:
            from ray._private.gcs_utils import cleanup_redis_storage

            cleanup_redis_storage(REDIS[0], REDIS[1], "", False, self.namespace)


class WorkerNode(_Node):
    """A `ray start --address=<head>` node. It waits up to `reconnect_seconds` for a lost GCS to come back.

    It runs in a PID namespace of its own, as on a host of its own: a Ray driver connects to a raylet it finds among
    the processes it can see, preferring the head's, so on one shared process table a driver placed on this node
    would attach to the head instead (and die with it).
    """

    def __init__(self, head: ExternalHead, *, num_cpus: int = 3, reconnect_seconds: int = 120) -> None:
        super().__init__("shrw-")
        self.head, self.num_cpus, self.reconnect_seconds = head, num_cpus, reconnect_seconds

    def start(self) -> None:
        env = self.head.environment()
        env["RAY_gcs_rpc_server_reconnect_timeout_s"] = str(self.reconnect_seconds)
        self._spawn([
            "unshare", "--pid", "--fork", "--mount-proc",
            *RAY_START, "--block", f"--address={self.head.gcs_address}", "--node-ip-address=127.0.0.1",
            f"--num-cpus={self.num_cpus}", f"--temp-dir={self.temp_dir}",
            f"--dashboard-agent-listen-port={free_port()}", "--disable-usage-stats",
        ], env)  # fmt: skip


def serve_against(head: ExternalHead, tmp_path: Path, **extra: str) -> Any:
    """A `shunter serve` (SQLite under tmp_path) on `head`, with the tests' short tick and lease; `extra` settings."""
    from tests.service.conftest import Service

    port = free_port()
    env = dict(os.environ)
    env.update({
        "SHUNTER_DATABASE_URL": f"sqlite:///{tmp_path / 'shunter.db'}", "SHUNTER_DATA_DIR": str(tmp_path),
        "SHUNTER_STORAGE_URI": str(tmp_path / "checkpoints"), "SHUNTER_RAY_ADDRESS": head.gcs_address,
        "SHUNTER_RAY_DASHBOARD_URL": head.dashboard_url, "SHUNTER_PORT": str(port),
        "SHUNTER_DISPATCHER_TICK_SECONDS": "0.25", "SHUNTER_LEASE_SECONDS": "5",
        "PYTHONUNBUFFERED": "1", **extra,
    })  # fmt: skip
    return Service(data_dir=tmp_path, port=port, env=env).start()
