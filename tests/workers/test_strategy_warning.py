"""A strategy the spec asks for and the train loop never applies does not pass silently: the driver (through its Train
callback) records a `warning` event and a line in `Job.warnings`; a loop that calls `workers.strategies.prepare`
gets none. Real TorchTrainer runs through `workers.driver.run`, reporting over HTTP to a real API on a real SQLite
database."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from service.lifecycle.reports import record_warning
from service.spec.job import JobSpec
from service.store.db import make_engine
from service.store.migrate import upgrade
from service.store.models import EndReason, EventKind, Job, JobEvent, JobState
from tests.live_api import live_api
from workers.context import STRATEGY_METRIC
from workers.driver import run, strategy_to_check
from workers.progress import STRATEGY_NOT_APPLIED

ONE_WORKER = {"num_workers": 1, "resources_per_worker": {"CPU": 1}}


def silent_loop(config: dict[str, Any]) -> None:
    """A train loop that trains nothing and never reports."""


def _database(tmp_path: Path) -> tuple[str, Engine]:
    url = f"sqlite:///{tmp_path / 'shunter.db'}"
    engine = make_engine(url)
    upgrade(engine)
    return url, engine


def _running_job(engine: Engine, spec: JobSpec) -> str:
    with Session(engine) as session:
        job = Job(name="strategy-check", spec=spec.model_dump(mode="json"), state=JobState.RUNNING, attempt=1)
        session.add(job)
        session.commit()
        return job.id


def _warnings(engine: Engine, job_id: str) -> tuple[Job, list[JobEvent]]:
    with Session(engine) as session:
        job = session.get(Job, job_id)
        events = session.exec(
            select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.kind == EventKind.WARNING.value)
        ).all()
        assert job is not None
        return job, list(events)


def _run(tmp_path: Path, spec: dict[str, Any]) -> tuple[Job, list[JobEvent]]:
    _, engine = _database(tmp_path)
    job_spec = JobSpec.model_validate({"resources": ONE_WORKER, **spec})
    job_id = _running_job(engine, job_spec)
    with live_api(engine, tmp_path) as api:
        storage = str(tmp_path / "storage")
        reason, message = run(job_spec, job_id=job_id, attempt=1, storage=storage, api=api.attempt_api(job_id))
    assert reason is EndReason.SUCCEEDED, message
    try:
        return _warnings(engine, job_id)
    finally:
        engine.dispose()


def test_only_fsdp_and_deepspeed_outside_script_mode_are_checked() -> None:
    def spec(kind: str, **entry: Any) -> JobSpec:
        return JobSpec.model_validate({"entrypoint": entry or {"callable": "a:b"}, "strategy": {"kind": kind}})

    assert strategy_to_check(spec("ddp")) is None
    assert strategy_to_check(spec("fsdp")).value == "fsdp"  # type: ignore[union-attr]
    assert strategy_to_check(spec("deepspeed", recipe="causal-lm")).value == "deepspeed"  # type: ignore[union-attr]
    assert strategy_to_check(spec("fsdp", script="train.py")) is None  # a script applies its own strategy


def test_record_warning_is_fenced_by_attempt_and_recorded_once(tmp_path: Path) -> None:
    _, engine = _database(tmp_path)
    job_id = _running_job(engine, JobSpec.model_validate({"entrypoint": {"callable": "a:b"}}))
    assert not record_warning(engine, job_id=job_id, attempt=2, code="c", message="from another attempt")
    assert record_warning(engine, job_id=job_id, attempt=1, code="c", message="heads up")
    assert not record_warning(engine, job_id=job_id, attempt=1, code="c", message="heads up")  # the driver, again
    job, events = _warnings(engine, job_id)
    assert job.warnings == ["heads up"]
    assert [(e.reason, e.message, e.attempt) for e in events] == [("c", "heads up", 1)]
    from api.routes.jobs import to_public

    quiet = _running_job(engine, JobSpec.model_validate({"entrypoint": {"callable": "a:b"}}))
    with Session(engine) as session:  # what GET /v1/jobs/{id} answers
        assert to_public(session.get(Job, job_id), session).warnings == ["heads up"]  # type: ignore[arg-type]
        assert to_public(session.get(Job, quiet), session).warnings == []  # type: ignore[arg-type]
    engine.dispose()


@pytest.mark.slow
def test_plain_loop_under_fsdp_spec_gets_a_warning(ray_connected: object, tmp_path: Path) -> None:
    job, events = _run(
        tmp_path,
        {
            "entrypoint": {"callable": "examples.mlp:train_loop"},  # prepare_model: DDP, whatever the spec says
            "config": {"total_steps": 3, "checkpoint_every": 100, "report_every": 1},
            "strategy": {"kind": "fsdp"},
        },
    )
    assert job.step == 3  # the reports were recorded as usual
    assert [(e.reason, e.attempt) for e in events] == [(STRATEGY_NOT_APPLIED, 1)]  # once, not once per report
    assert job.warnings == [events[0].message]
    assert "strategy.kind is fsdp" in job.warnings[0] and "workers.strategies.prepare" in job.warnings[0]


@pytest.mark.slow
def test_loop_that_never_reports_gets_a_warning_from_the_driver(ray_connected: object, tmp_path: Path) -> None:
    job, events = _run(
        tmp_path,
        {"entrypoint": {"callable": f"{__name__}:silent_loop"}, "strategy": {"kind": "fsdp"}},
    )
    assert [e.reason for e in events] == [STRATEGY_NOT_APPLIED]
    assert job.warnings == [events[0].message]


@pytest.mark.slow
def test_loop_that_calls_prepare_gets_no_warning(ray_connected: object, tmp_path: Path) -> None:
    job, events = _run(
        tmp_path,
        {
            "entrypoint": {"callable": "tests.workers.loops:strategy_loop"},
            "config": {"strategy": {"kind": "fsdp"}, "out": str(tmp_path), "steps": 2, "tag": "prepared"},
            "strategy": {"kind": "fsdp"},
        },
    )
    assert job.step == 2
    assert events == [] and not job.warnings
    assert STRATEGY_METRIC not in (job.latest_metrics or {})  # shunter's marker is not one of the job's metrics
