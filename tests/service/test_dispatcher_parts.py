"""The dispatcher as parts (issue 36, item 3): its tick is a list of named steps, its phases are objects given their
collaborators (no mixins), and the retry and admission policies are injected, so a test swaps them in. On the real
dispatcher and a real database, with the noop backend standing in for Ray (what Ray does is not what is tested)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from sqlalchemy.engine import Engine
from sqlmodel import Session

from service.backends.noop import NoopJobs
from service.config.settings import Settings
from service.core.backend import submission_id
from service.dispatch.dispatcher import Dispatcher
from service.lifecycle import jobs
from service.policy.retry import RetryDecision
from service.spec.job import JobSpec
from service.store.models import EndReason, Job, JobState
from service.tenancy.auth import Caller

ROOT = Path(__file__).resolve().parents[2]


def _settings(tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path / "data", storage_uri=str(tmp_path / "ckpt"))


def _submit(db: Engine, settings: Settings) -> str:
    spec = JobSpec.model_validate({"entrypoint": {"callable": "examples.mlp:train_loop"},
                                   "resources": {"num_workers": 1}, "retries": {"max_attempts": 3}})  # fmt: skip
    with Session(db) as session:
        job, _ = jobs.submit(session, spec, caller=Caller(owner="alice"), settings=settings)
        session.commit()
        return job.id


def _state(db: Engine, job_id: str) -> Job:
    with Session(db) as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job


def test_the_tick_is_its_named_steps_in_order(db: Engine, tmp_path: Path) -> None:
    disp = Dispatcher(engine=db, settings=_settings(tmp_path), ray=NoopJobs(tmp_path / "noop"), owner="d1")
    try:
        assert [name for name, _ in disp.steps] == ["leases", "cluster", "reconcile", "admit", "late logs", "chores"]
    finally:
        disp._pool.shutdown(wait=True)


def test_an_injected_retry_policy_decides_the_end(db: Engine, tmp_path: Path) -> None:
    """The same end (Ray says FAILED, the driver said nothing: infra, retryable) with two retry policies: the default
    one requeues the job; one that never retries ends it."""
    settings, backend = _settings(tmp_path), NoopJobs(tmp_path / "noop", run_seconds=3600)
    asked: list[EndReason] = []

    def never(**facts: Any) -> RetryDecision:
        asked.append(facts["reason"])
        return RetryDecision(False, why="the injected policy never retries")

    for policy, expected in ((None, JobState.QUEUED), (never, JobState.FAILED)):
        extra = {"retry_policy": policy} if policy is not None else {}
        disp = Dispatcher(engine=db, settings=settings, ray=backend, owner=f"d-{expected.value}", **extra)
        try:
            job_id = _submit(db, settings)
            disp.tick()  # admitted and submitted
            assert _state(db, job_id).state in (JobState.STARTING, JobState.RUNNING)
            backend.fail(submission_id(job_id, 1))
            disp.tick()
            job = _state(db, job_id)
            assert job.state == expected, (job.state, job.last_error)
        finally:
            disp._pool.shutdown(wait=True)
    assert asked == [EndReason.INFRA]


def test_an_injected_admission_decides_what_starts(db: Engine, tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    calls: list[str] = []

    def admits_nothing(*args: Any, **kwargs: Any) -> tuple[list[Job], list[Job]]:
        calls.append(kwargs["owner"])
        return [], []

    disp = Dispatcher(engine=db, settings=settings, ray=NoopJobs(tmp_path / "noop"), owner="d1", admit=admits_nothing)
    try:
        job_id = _submit(db, settings)
        disp.tick()
        assert calls == ["d1"] and _state(db, job_id).state == JobState.QUEUED
    finally:
        disp._pool.shutdown(wait=True)


def test_the_dispatcher_is_parts_not_mixins() -> None:
    """No phase is a mixin that stubs its siblings' methods: the Dispatcher derives from nothing, and nothing under
    service/dispatch/ raises NotImplementedError."""
    for path in (ROOT / "service" / "dispatch").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name == "Dispatcher":
                assert node.bases == [], "Dispatcher inherits its phases"
            if isinstance(node, ast.Raise) and node.exc is not None:
                name = getattr(node.exc, "id", None) or getattr(getattr(node.exc, "func", None), "id", None)
                assert name != "NotImplementedError", f"{path.name}:{node.lineno}"
