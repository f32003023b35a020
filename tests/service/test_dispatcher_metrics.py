"""Issue 38, item 6: a standalone `shunter dispatcher` serves its own /metrics, and its tick histogram moves.

A real process (the CLI's `dispatcher`), a real SQLite file, the noop backend; scraped over HTTP twice."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from service.backends.ray_local import free_port
from service.store.db import make_engine
from service.store.migrate import upgrade
from tests.conftest import wait_for

REPO = Path(__file__).resolve().parents[2]


def ticks(text: str) -> float:
    found = re.search(r"^shunter_dispatcher_tick_seconds_count (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_standalone_dispatcher_serves_its_tick_histogram_and_process_metrics(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'd.db'}")
    upgrade(engine)
    engine.dispose()
    port = free_port()
    env = {**os.environ, "SHUNTER_DATABASE_URL": f"sqlite:///{tmp_path / 'd.db'}", "SHUNTER_DATA_DIR": str(tmp_path),
           "SHUNTER_BACKEND": f"noop:{tmp_path / 'noop'}", "SHUNTER_DISPATCHER_TICK_SECONDS": "0.1",
           "SHUNTER_DISPATCHER_METRICS_PORT": str(port), "SHUNTER_STORAGE_URI": str(tmp_path / "ckpt")}  # fmt: skip
    log = open(tmp_path / "dispatcher.log", "wb")  # noqa: SIM115 - the child writes it
    proc = subprocess.Popen([sys.executable, "-m", "api.cli", "dispatcher"], env=env, cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}/metrics"

    def scrape() -> str | None:
        assert proc.poll() is None, (tmp_path / "dispatcher.log").read_text()[-3000:]
        try:
            return httpx.get(url, timeout=2).text
        except httpx.HTTPError:
            return None

    try:
        first = wait_for(lambda: (t := scrape()) and ticks(t) > 0 and t, timeout=60, what=url)
        assert "process_cpu_seconds_total" in first and "process_resident_memory_bytes" in first
        wait_for(lambda: ticks(scrape() or "") > ticks(first), timeout=30, what="the tick count to move")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        log.close()
    assert proc.returncode in (0, -signal.SIGTERM)
