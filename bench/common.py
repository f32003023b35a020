"""Shared helpers: process groups that are always stopped, fresh databases, bulk enqueue, a local Ray head."""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
PG_ADMIN_URL = os.environ.get("SHUNTER_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
SPEC = {"entrypoint": {"callable": "examples.mlp:train_loop"}, "resources": {"num_workers": 1}}
_PROCS: list[subprocess.Popen[bytes]] = []


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), nearest rank."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def wait_for(pred: Callable[[], Any], *, timeout: float, interval: float = 0.1, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


# ---- processes ------------------------------------------------------------------------------------------------
def spawn(
    cmd: list[str], *, env: dict[str, str] | None = None, log_path: Path | None = None
) -> subprocess.Popen[bytes]:
    """A child in its own process group (so stop() ends it and all its children)."""
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - the child keeps it
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    _PROCS.append(proc)
    return proc


def stop(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    # Children left in the group after the leader exited
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    if proc in _PROCS:
        _PROCS.remove(proc)


def stop_all() -> None:
    for proc in list(_PROCS):
        stop(proc, grace=5.0)


def base_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def shunter_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "api.cli", *args]


def wait_http(url: str, *, timeout: float = 60.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    def up() -> bool:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {proc.returncode}")
        try:
            return httpx.get(url, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(up, timeout=timeout, interval=0.2, what=url)


# ---- databases ------------------------------------------------------------------------------------------------
def postgres_available() -> bool:
    from service.store.db import reachable

    return reachable(PG_ADMIN_URL)


@contextlib.contextmanager
def fresh_db(kind: str, workdir: Path) -> Iterator[str]:
    """A new, migrated database: a SQLite file under workdir, or a new PostgreSQL database (dropped after)."""
    from sqlalchemy import text

    from service.store.db import make_engine
    from service.store.migrate import upgrade

    if kind == "sqlite":
        path = workdir / f"bench-{uuid.uuid4().hex[:8]}.db"
        url = f"sqlite:///{path}"
        engine = make_engine(url)
        upgrade(engine)
        engine.dispose()
        yield url
        return
    name = f"shunter_bench_{uuid.uuid4().hex[:10]}"
    admin = make_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    try:
        engine = make_engine(url)
        upgrade(engine)
        engine.dispose()
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def enqueue(engine: Any, n: int, *, chunk: int = 5000, offset: int = 0) -> None:
    """n QUEUED jobs (and their `submitted` events) in bulk, as tests/service/test_stress_dispatchers.py does."""
    from datetime import timedelta

    from sqlalchemy import insert
    from sqlmodel import Session

    from service.store.models import Job, JobEvent, JobState, new_job_id, utcnow

    base = utcnow()
    for start in range(0, n, chunk):
        rows = []
        for i in range(start, min(n, start + chunk)):
            at = base + timedelta(microseconds=i)
            rows.append({"id": new_job_id(), "name": f"noop-{offset + i}", "owner": "bench", "queue": "default",
                         "priority": (offset + i) % 3, "state": JobState.QUEUED, "spec": SPEC, "attempt": 0,
                         "created_at": at, "updated_at": at, "preemptions": 0})  # fmt: skip
        with Session(engine) as session:
            session.execute(insert(Job), rows)
            session.execute(
                insert(JobEvent),
                [{"job_id": r["id"], "kind": "state", "to_state": JobState.QUEUED, "reason": "submitted",
                  "at": r["created_at"]} for r in rows],
            )  # fmt: skip
            session.commit()


# ---- the shared local Ray head ---------------------------------------------------------------------------------
_HEAD: dict[str, Any] = {}


def ray_head() -> Any:
    """One warm local Ray head (2 CPUs) for every part that needs Ray; stopped by close_ray_head()."""
    from service.backends.ray_local import ensure_local_head

    if "head" not in _HEAD:
        data_dir = Path(tempfile.mkdtemp(prefix="shunter-bench-ray-"))
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        log("starting a local Ray head (2 CPUs)")
        started = time.monotonic()
        _HEAD["dir"] = data_dir
        _HEAD["head"] = ensure_local_head(data_dir, num_cpus=2)
        log(f"Ray head up in {time.monotonic() - started:.1f}s at {_HEAD['head'].gcs_address}")
    return _HEAD["head"]


def close_ray_head() -> None:
    from service.backends.ray_local import stop_local_head

    if "head" in _HEAD:
        log("stopping the local Ray head")
        stop_local_head(_HEAD["dir"])
        _HEAD.clear()


def ray_token_headers() -> dict[str, str]:
    token_file = Path.home() / ".ray" / "auth_token"
    if token_file.exists():
        return {"Authorization": f"Bearer {token_file.read_text().strip()}"}
    return {}
