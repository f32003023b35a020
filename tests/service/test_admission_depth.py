"""An admission pass reads the head of the queue, not all of it: its work on a real SQLite file, counted in SQLite VM
steps (the progress handler), hardly grows from 200 to 5,000 queued jobs.

What this guards, each once measured at 100k queued: the admission-order index rebuilt without its `priority DESC`
by a batch migration (every pass sorted the queue), fair share's owner list read as a `GROUP BY` over every queued
job, and `max_parallel`'s read of sweep members joined from every queued job (173 ms a pass, against 8 ms).
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import event, insert
from sqlmodel import Session

from service.config.settings import Settings
from service.core.backend import ClusterView, NodeView
from service.dispatch import admission
from service.spec.job import JobSpec
from service.store.db import make_engine
from service.store.migrate import upgrade
from service.store.models import Job, JobState, Sweep

NOW = datetime(2026, 12, 1, tzinfo=timezone.utc)
SPEC = {"entrypoint": {"callable": "examples.mlp:train_loop"}, "resources": {"num_workers": 1}}


def _fill(engine: Any, start: int, end: int) -> None:
    rows = [{"id": f"j{i:07d}", "name": f"j{i}", "owner": f"owner{i % 3}", "queue": "default", "priority": i % 3,
             "state": JobState.QUEUED, "spec": SPEC, "attempt": 0, "preemptions": 0, "waiting_on": 0,
             "created_at": NOW + timedelta(microseconds=i), "updated_at": NOW,
             "sweep_id": "s1" if i < 10 else None, "sweep_index": i if i < 10 else None}
            for i in range(start, end)]  # fmt: skip
    with Session(engine) as session:
        session.execute(insert(Job), rows)
        session.commit()


class Steps:
    """SQLite VM steps (in hundreds) run on the engine's connections while `counting`."""

    def __init__(self, engine: Any) -> None:
        self.steps, self.counting = 0, False
        event.listen(engine, "connect", lambda dbapi_conn, _: dbapi_conn.set_progress_handler(self._step, 100))

    def _step(self) -> int:
        self.steps += self.counting
        return 0  # go on


def _steps_of_a_pass(engine: Any, steps: Steps) -> int:
    none = ClusterView([NodeView("n0", "127.0.0.1", True, {"CPU": 0.0}, {"CPU": 0.0})])  # no room: every job waits
    steps.steps, steps.counting = 0, True
    try:
        started, _ = admission.admit(
            engine, Settings(), none, owner="test", now=NOW + timedelta(hours=1),
            spec_of=lambda job: (JobSpec.model_validate(job.spec), None),
            resources_of=lambda job: JobSpec.model_validate(job.spec).resources.total(),
        )  # fmt: skip
    finally:
        steps.counting = False
    assert started == []
    return steps.steps


def test_an_admission_pass_reads_the_queues_head_at_any_depth(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'deep.db'}")
    steps = Steps(engine)
    upgrade(engine)
    with Session(engine) as session:
        session.add(Sweep(id="s1", name="s", owner="owner0", request={}, values=[], max_parallel=2, created_at=NOW))
        session.commit()
    _fill(engine, 0, 200)
    _steps_of_a_pass(engine, steps)  # the first pass writes each waiting job's reason
    shallow = _steps_of_a_pass(engine, steps)
    _fill(engine, 200, 5000)
    _steps_of_a_pass(engine, steps)
    deep = _steps_of_a_pass(engine, steps)
    assert shallow > 0
    assert deep < 2 * shallow, f"{deep} VM steps (x100) at 5000 queued against {shallow} at 200"
    engine.dispose()
