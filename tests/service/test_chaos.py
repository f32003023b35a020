"""Issue 13, item 4: the chaos run, CI-sized. PostgreSQL, an external Ray head, two `shunter api` and two `shunter
dispatcher` processes; 7 short checkpointing jobs while 8 random SIGKILLs hit the shunter processes and the Ray
head is killed and started again once (tests/chaos.py holds the harness and the invariants; bench/chaos.py runs the
long version).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chaos import Chaos
from tests.service.conftest import fresh_pg_database

pytestmark = pytest.mark.slow


@pytest.fixture
def pg_url() -> Iterator[str]:
    with fresh_pg_database("shunter_chaos") as url:
        yield url


def test_chaos_every_job_succeeds_nothing_runs_twice(tmp_path: Path, pg_url: str) -> None:
    chaos = Chaos(tmp_path, pg_url, seed=13, jobs=7, kills=8, steps=30, checkpoint_every=5, gap=(1.0, 5.0))
    chaos.start()
    try:
        report = chaos.run(timeout=900)
    finally:
        chaos.stop()
    summary = report.summary()
    print(json.dumps(summary))
    assert report.problems == [], json.dumps(summary, indent=2)
    assert sum(report.kills.values()) >= 6 and report.head_restarts == 1, summary
    # The head restart really cut into training: attempts ended with it, and at least one resumed from a checkpoint.
    assert report.end_reasons["cluster_restarted"] >= 1 and report.resumed_attempts >= 1, summary
