"""How long one progress report takes: straight to a SQLite file (how jobs reported before issue 12) vs through the
internal API with an attempt token (a live uvicorn in another process, on loopback; the worker's own client).

    .venv/bin/python -m bench.progress_latency [--reports 200]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from sqlmodel import Session

from service.backends.ray_local import free_port
from service.config.settings import Settings
from service.lifecycle.reports import record_report
from service.store.db import make_engine
from service.store.migrate import upgrade
from service.store.models import Job, JobState
from service.tenancy import attempt_tokens
from workers.attempt_api import AttemptApi

SERVER = """
import sys, uvicorn
from api.app import create_app
from service.config.settings import Settings
settings = Settings(database_url=sys.argv[1], backend="noop:" + sys.argv[2], data_dir=sys.argv[2])
uvicorn.run(create_app(settings), host="127.0.0.1", port=int(sys.argv[3]), log_level="warning")
"""


def _job(engine) -> str:  # noqa: ANN001
    with Session(engine) as session:
        job = Job(name="bench", spec={"entrypoint": {"callable": "a:b"}}, state=JobState.RUNNING, attempt=1)
        session.add(job)
        session.commit()
        return job.id


def _time(call: Callable[[int], object], n: int) -> list[float]:
    for i in range(10):  # warm up: connections, caches
        call(-1 - i)
    out = []
    for i in range(n):
        start = time.perf_counter()
        call(i)
        out.append((time.perf_counter() - start) * 1000)
    return out


def _summary(name: str, ms: list[float]) -> str:
    ms = sorted(ms)
    p95 = ms[int(len(ms) * 0.95) - 1]
    return f"{name:<34} n={len(ms)}  mean {statistics.mean(ms):6.2f} ms  p50 {ms[len(ms) // 2]:6.2f}  p95 {p95:6.2f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reports", type=int, default=200)
    n = parser.parse_args().reports
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'bench.db'}"
        engine = make_engine(url)
        upgrade(engine)
        direct_job = _job(engine)
        metrics = {"loss": 0.25, "lr": 1e-3, "epoch": 1, "throughput": 1234.5}

        def direct(i: int) -> object:
            return record_report(engine, job_id=direct_job, attempt=1, metrics={**metrics, "step": max(i, 0)})

        before = _time(direct, n)

        api_job = _job(engine)
        port = free_port()
        server = subprocess.Popen([sys.executable, "-c", textwrap.dedent(SERVER), url, tmp, str(port)])
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit("the API did not start")
                time.sleep(0.1)
            key = attempt_tokens.keys_for(engine, Settings(database_url=url)).current
            api = AttemptApi(f"http://127.0.0.1:{port}", attempt_tokens.issue(api_job, 1, key), api_job, 1)

            def over_http(i: int) -> object:
                assert api.report({**metrics, "step": max(i, 0)}, step=max(i, 0))
                return None

            after = _time(over_http, n)
        finally:
            server.terminate()
            server.wait(timeout=30)
        engine.dispose()
    print(_summary("before: record_report on SQLite", before))
    print(_summary("after: POST /internal/... (uvicorn)", after))


if __name__ == "__main__":
    main()
