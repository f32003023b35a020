"""A local Ray head that shunter starts and re-attaches to.

It is started with `ray start --head` (daemonised), not `ray.init()`, so that it outlives a killed `shunter serve`:
the running Ray Jobs survive and the restarted service adopts them. Its addresses are kept in
`<data_dir>/ray-head.json`; stopping it ends only the processes of this head, never another Ray on the machine.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from service.backends.ray_jobs import ray_auth_headers
from service.core.errors import InfraError
from service.core.locations import STORE_LOCATION_ENV

log = logging.getLogger(__name__)
STATE_FILE = "ray-head.json"


@dataclass(frozen=True)
class LocalHead:
    gcs_address: str
    dashboard_url: str
    temp_dir: str


# `ray start` with shunter's worker launcher (`service.backends.ray_start`): ~0.5 CPU-s less for every worker process
# Ray starts.
RAY_START = (sys.executable, "-m", "service.backends.ray_start")


# Ports a head is told to listen on are picked below the kernel's ephemeral range and above Ray's worker ports
# (10002-19999). A port picked free from the ephemeral range could be handed, before Ray binds it, to any socket that
# binds port 0 or connects out: a slow run lost its whole lane when another cluster's raylet, starting meanwhile,
# took the port just picked for this head's dashboard agent (which then serves no HTTP: "No available agent").
PICK_LOW = 20000


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A port free now on every address, outside the range the kernel hands out by itself (see PICK_LOW); from that
    range only when it leaves no room below it."""
    high = _ephemeral_low() - 1
    if high - PICK_LOW >= 1000:
        for _ in range(200):
            port = random.randint(PICK_LOW, high)
            if _port_free(port, "0.0.0.0"):
                return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def dashboard_answers(url: str, timeout: float = 2.0) -> bool:
    """Whether the dashboard answers, with the cluster's token where Ray's token auth is on (a `ray start` turns it on
    by itself when ~/.ray/auth_token exists, which any earlier `ray.init()` on this host may have written)."""
    try:
        return httpx.get(f"{url}/api/version", timeout=timeout, headers=ray_auth_headers()).status_code == 200
    except httpx.HTTPError:
        return False


def _temp_dir_for(data_dir: Path) -> str:
    # Ray's unix socket paths must stay under ~107 bytes: a short, per-data-dir folder in /tmp.
    digest = hashlib.sha1(str(data_dir.resolve()).encode()).hexdigest()[:10]
    return f"/tmp/shunter-ray-{digest}"


# The environment of a local head is allow-listed: Ray's processes, and so every job's driver and workers, inherit it,
# and nothing of the service's may reach a job (SHUNTER_DATABASE_URL, SHUNTER_API_TOKENS, SHUNTER_PROGRESS_SECRET,
# AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, HF_TOKEN, ...). What passes: these names, and the
# names starting with HEAD_ENV_PREFIXES. Jobs write `s3://` checkpoints with the cluster's own credentials (an instance
# role, or the default credentials file of the user running the head), never with the service's.
HEAD_ENV_NAMES = frozenset(STORE_LOCATION_ENV) | frozenset(
    {
        "PATH", "HOME", "USER", "LOGNAME", "SHELL", "HOSTNAME", "TERM", "TZ", "LANG", "LANGUAGE",
        "TMPDIR", "TEMP", "TMP", "PYTHONPATH", "PYTHONUNBUFFERED", "VIRTUAL_ENV", "LD_LIBRARY_PATH",
        "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS", "TOKENIZERS_PARALLELISM",
        "XDG_CACHE_HOME", "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE",
        "TORCH_HOME", "TORCH_EXTENSIONS_DIR", "DS_ACCELERATOR", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES",
        "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE",
        "REPORTER_UPDATE_INTERVAL_MS", "METRICS_RECORD_INTERVAL_S",  # Ray's own knobs without its RAY_ prefix
    }
)  # fmt: skip
HEAD_ENV_PREFIXES = ("LC_", "RAY_", "OMP_", "MKL_", "CUDA_", "NCCL_", "GLOO_")


def interpreter_bin_first(path: str) -> str:
    """`path` with this interpreter's bin directory first (once), so its processes find the venv's tools (`ray`, and
    the `ninja` that builds DeepSpeed's ops: see `workers.warmup.use_interpreter_bin_first`) before the system's."""
    bin_dir = str(Path(sys.executable).parent)
    return os.pathsep.join([bin_dir, *(p for p in path.split(os.pathsep) if p and p != bin_dir)])


def head_environment(extra_pythonpath: str | None = None) -> dict[str, str]:
    """The environment Ray's processes (and so each job's driver) inherit: the allow-listed part of this one."""
    env = {k: v for k, v in os.environ.items() if k in HEAD_ENV_NAMES or k.startswith(HEAD_ENV_PREFIXES)}
    env["PATH"] = interpreter_bin_first(env.get("PATH", ""))
    # Ray Train aborts gracefully on SIGINT; the default SIGTERM is ignored by the driver and escalated to a kill.
    env["RAY_JOB_STOP_SIGNAL"] = "SIGINT"
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    paths = [p for p in (extra_pythonpath, env.get("PYTHONPATH")) if p]
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def ensure_local_head(
    data_dir: Path,
    *,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    dashboard_port: int | None = None,
    resources: dict[str, float] | None = None,
    ready_seconds: float = 180.0,
    tries: int = 2,
) -> LocalHead:
    """Re-attach to this data dir's Ray head if it still answers, else start a new one.

    A head whose dashboard does not answer within `ready_seconds` is stopped (none of its processes is left behind
    to load the machine) and started again on fresh ports, `tries` times in all; the error then carries the tail of
    its dashboard log. (CI once saw a head not answer in 60 s on a loaded 2-core machine: 47 tests errored on it.)"""
    data_dir.mkdir(parents=True, exist_ok=True)
    state = data_dir / STATE_FILE
    if state.exists():
        with contextlib.suppress(ValueError, TypeError, KeyError):
            head = LocalHead(**json.loads(state.read_text()))
            if dashboard_answers(head.dashboard_url):
                log.info("re-attached to local Ray head at %s", head.gcs_address)
                return head
        stop_local_head(data_dir)
    for attempt in range(1, tries + 1):
        try:
            head = _start_head(data_dir, num_cpus, num_gpus, dashboard_port if attempt == 1 else None, resources,
                               ready_seconds)  # fmt: skip
        except InfraError as exc:
            stop_local_head(data_dir)
            if attempt == tries:
                raise
            log.warning("local Ray head, try %d of %d: %s; starting it again", attempt, tries, exc)
            continue
        state.write_text(json.dumps(asdict(head)))
        return head
    raise AssertionError("unreachable")


def _start_head(
    data_dir: Path,
    num_cpus: int | None,
    num_gpus: int | None,
    dashboard_port: int | None,
    resources: dict[str, float] | None,
    ready_seconds: float,
) -> LocalHead:
    temp_dir = _temp_dir_for(data_dir)
    port = free_port()
    dport = dashboard_port or free_port()
    if dashboard_port and not _port_free(dashboard_port):
        dport = free_port()
    cmd = [
        *RAY_START, "--head",
        "--node-ip-address=127.0.0.1", f"--port={port}",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dport}",
        # The defaults (client server 10001, agent 52365) collide between heads on one machine: the second head's
        # job agent then never comes up and every submission answers "No available agent to submit job".
        f"--ray-client-server-port={free_port()}",
        f"--dashboard-agent-listen-port={free_port()}",
        f"--temp-dir={temp_dir}", "--disable-usage-stats",
    ]  # fmt: skip
    if num_cpus is not None:
        cmd.append(f"--num-cpus={num_cpus}")
    if num_gpus is not None:
        cmd.append(f"--num-gpus={num_gpus}")
    if resources:
        cmd.append(f"--resources={json.dumps(resources)}")
    started = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, env=head_environment(str(Path.cwd())), capture_output=True, text=True, timeout=120, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise InfraError("`ray start --head` did not return within 120 s") from exc
    if proc.returncode != 0:
        raise InfraError(f"`ray start --head` failed: {proc.stderr.strip()[-2000:]}")
    head = LocalHead(gcs_address=f"127.0.0.1:{port}", dashboard_url=f"http://127.0.0.1:{dport}", temp_dir=temp_dir)
    deadline = time.monotonic() + ready_seconds
    while not dashboard_answers(head.dashboard_url):
        if time.monotonic() > deadline:
            raise InfraError(f"Ray dashboard at {head.dashboard_url} did not answer within {ready_seconds:.0f} s; "
                             f"its log ends:\n{_dashboard_log_tail(temp_dir)}")  # fmt: skip
        time.sleep(0.2)
    log.info("started local Ray head %s in %.1f s", head.gcs_address, time.monotonic() - started)
    return head


def _dashboard_log_tail(temp_dir: str, chars: int = 3000) -> str:
    logs = Path(temp_dir, "session_latest", "logs")
    parts = []
    for name in ("dashboard.log", "dashboard.err"):
        with contextlib.suppress(OSError):
            text = (logs / name).read_text(errors="replace")[-chars:]
            if text.strip():
                parts.append(f"--- {name}\n{text}")
    return "\n".join(parts) or f"(no dashboard log under {logs})"


def _port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def head_processes(temp_dir: str) -> list[int]:
    """Every process of the head whose Ray temp dir is `temp_dir`: those naming it on their command line, everything
    they started (the raylet's agents retitle themselves `ray::DashboardAgent`, `ray::RuntimeEnvAgent`, and the
    dashboard's modules `ray-dashboard-*`, so no longer name it), and the Ray Client server, which names only the
    GCS's port. Missed, an agent outlives its head by minutes spinning a core on reconnects (CI's slow tier lost
    a core to them after every test that stops a head)."""
    import psutil

    roots: list[psutil.Process] = []
    ports: set[str] = set()
    clients: list[tuple[psutil.Process, str]] = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        args = proc.info.get("cmdline") or []
        if proc.info["pid"] == os.getpid():
            continue
        if temp_dir in " ".join(args):
            roots.append(proc)
            ports.update(a.split("=", 1)[1] for a in args if a.startswith("--gcs_server_port="))
        elif "ray.util.client.server" in args:
            clients.append((proc, next((a.rsplit(":", 1)[-1] for a in args if a.startswith("--address=")), "")))
    found: dict[int, None] = {}
    for proc in roots + [proc for proc, port in clients if port in ports]:
        found[proc.pid] = None
        with contextlib.suppress(psutil.Error):
            for child in proc.children(recursive=True):
                if child.pid != os.getpid():
                    found[child.pid] = None
    return list(found)


def stop_local_head(data_dir: Path, grace_seconds: float = 5.0) -> None:
    """End every process of this data dir's head (SIGTERM, then SIGKILL after a grace period)."""
    temp_dir = _temp_dir_for(data_dir)
    import psutil

    pids = head_processes(temp_dir)
    # Workers and drivers of that head carry the session dir in their cmdline too; the GCS and raylet go last.
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in pids):
        time.sleep(0.1)
    # Until none is left: a SIGKILL takes effect a moment later, and a raylet still alive at the first sweep may
    # have started a worker since (the caller expects the head gone once this returns).
    deadline = time.monotonic() + grace_seconds
    while (left := head_processes(temp_dir)) and time.monotonic() < deadline:
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    (data_dir / STATE_FILE).unlink(missing_ok=True)
