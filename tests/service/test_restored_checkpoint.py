"""An attempt says which checkpoint Ray Train restored for it (`/internal/v1/attempts/<job>/<n>/restored`), so a
checkpoint whose own report was lost (a Ray head killed between Ray Train's record of it and the report reaching the
API; the chaos run saw it) is listed, and is the job's latest, all the same. On SQLite and PostgreSQL; through the
real HTTP API with attempt tokens; and from a real TorchTrainer resuming a run whose first fit reported nothing.
"""

from __future__ import annotations

import functools
import os
import pickle
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from service.lifecycle.reports import record_report, record_restore
from service.store.db import make_engine
from service.store.migrate import upgrade
from service.store.models import Attempt, Checkpoint, Job, JobEvent, JobState
from service.tenancy import attempt_tokens
from tests.live_api import add_attempt, live_api
from workers.attempt_api import AttemptApi, AttemptApiError

SECRET = "restored-test-key-" + "k" * 24
SPEC = {"entrypoint": {"callable": "examples.mlp:train_loop"}}


def job_on_attempt(db: Engine, attempt: int) -> Job:
    job = Job(name="j", spec=SPEC, state=JobState.RUNNING, attempt=attempt)
    add_attempt(db, job)
    with Session(db) as session:
        for n in range(1, attempt):
            session.add(Attempt(job_id=job.id, number=n, submission_id=f"shunter-{job.id}-{n}"))
        session.commit()
    return job


def rows(db: Engine, job_id: str) -> list[tuple[int, int | None, str, bool]]:
    with Session(db) as session:
        found = session.exec(select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(col(Checkpoint.id)))
        return [(c.attempt, c.step, c.uri, c.complete) for c in found]


def restored_events(db: Engine, job_id: str) -> list[tuple[int | None, str | None]]:
    with Session(db) as session:
        found = session.exec(
            select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.reason == "checkpoint_restored")
        )
        return [(e.attempt, e.message) for e in found]


def latest(db: Engine, job_id: str) -> str | None:
    with Session(db) as session:
        return session.get(Job, job_id).latest_checkpoint  # type: ignore[union-attr]


def test_a_checkpoint_shunter_never_heard_of_is_listed_as_its_writers_and_becomes_the_latest(db: Engine) -> None:
    job = job_on_attempt(db, 2)
    assert record_restore(db, job_id=job.id, attempt=2, checkpoint_uri="/s/j/ck5", step=5, written_by=1)
    assert rows(db, job.id) == [(1, 5, "/s/j/ck5", True)]
    assert latest(db, job.id) == "/s/j/ck5"
    [(attempt, message)] = restored_events(db, job.id)
    assert attempt == 2 and message == (
        "attempt 2 resumed from /s/j/ck5 (step 5); its report had not reached shunter, so it is listed now"
    )
    # A restarted worker group restores the same checkpoint again: said once per attempt, listed once.
    assert not record_restore(db, job_id=job.id, attempt=2, checkpoint_uri="/s/j/ck5", step=5, written_by=1)
    assert len(rows(db, job.id)) == 1 and len(restored_events(db, job.id)) == 1


def test_a_listed_checkpoint_is_not_listed_again(db: Engine) -> None:
    job = job_on_attempt(db, 1)
    for step in (5, 10):
        record_report(db, job_id=job.id, attempt=1, metrics={"step": step}, checkpoint_uri=f"/s/j/ck{step}")
    with Session(db) as session:
        row = session.get(Job, job.id)
        row.attempt = 2  # type: ignore[union-attr]
        session.add(row)
        session.add(Attempt(job_id=job.id, number=2, submission_id=f"shunter-{job.id}-2"))
        session.commit()
    # Ray Train restored an older checkpoint than shunter's newest: said, nothing listed twice, latest kept.
    assert record_restore(db, job_id=job.id, attempt=2, checkpoint_uri="/s/j/ck5", step=5, written_by=1)
    assert rows(db, job.id) == [(1, 5, "/s/j/ck5", True), (1, 10, "/s/j/ck10", True)]
    assert latest(db, job.id) == "/s/j/ck10"
    assert restored_events(db, job.id) == [(2, "attempt 2 resumed from /s/j/ck5 (step 5)")]


@pytest.mark.parametrize(
    ("written_by", "listed_as"),
    [(None, 3), (2, 2), (3, 3), (4, 3), (0, 3)],  # unknown, or not an earlier/this attempt: the one that says it
)
def test_the_writer_is_believed_only_when_it_is_an_earlier_or_this_attempt(
    db: Engine, written_by: int | None, listed_as: int
) -> None:
    job = job_on_attempt(db, 3)
    assert record_restore(db, job_id=job.id, attempt=3, checkpoint_uri="/s/ck", step=None, written_by=written_by)
    assert rows(db, job.id) == [(listed_as, None, "/s/ck", True)]


def test_an_incomplete_checkpoint_is_listed_but_never_the_latest(db: Engine) -> None:
    job = job_on_attempt(db, 2)
    assert record_restore(db, job_id=job.id, attempt=2, checkpoint_uri="/s/ck7", step=7, complete=False)
    assert rows(db, job.id) == [(2, 7, "/s/ck7", False)] and latest(db, job.id) is None


def test_an_attempt_that_is_not_current_writes_nothing(db: Engine) -> None:
    job = job_on_attempt(db, 2)
    assert not record_restore(db, job_id=job.id, attempt=1, checkpoint_uri="/s/ck5", step=5)
    with Session(db) as session:
        row = session.get(Job, job.id)
        row.state = JobState.SUCCEEDED  # type: ignore[union-attr]
        session.add(row)
        session.commit()
    assert not record_restore(db, job_id=job.id, attempt=2, checkpoint_uri="/s/ck5", step=5)
    assert rows(db, job.id) == [] and restored_events(db, job.id) == []


def test_the_route_takes_the_attempts_own_token_and_refuses_bad_bodies(db: Engine, tmp_path: Path) -> None:
    job = job_on_attempt(db, 2)
    with live_api(db, tmp_path, progress_secret=SECRET) as api:
        mine = AttemptApi(api.url, attempt_tokens.issue(job.id, 2, SECRET), job.id, 2)
        assert mine.restored("/s/ck5", step=5, complete=True, written_by=1)
        assert rows(db, job.id) == [(1, 5, "/s/ck5", True)]
        stale = AttemptApi(api.url, attempt_tokens.issue(job.id, 1, SECRET), job.id, 1)
        assert not stale.restored("/s/ck9", step=9, complete=True, written_by=None)  # fenced: not current
        other = AttemptApi(api.url, attempt_tokens.issue(job.id, 1, SECRET), job.id, 2)  # a token of attempt 1
        with pytest.raises(AttemptApiError) as refused:
            other.restored("/s/ck9", step=9, complete=True, written_by=None)
        assert refused.value.status_code == 403
        # What a train worker raises reaches Ray's controller pickled: it must come back whole (httpx's own error
        # does not, and Ray then reported a failed health check instead of the refusal).
        again = pickle.loads(pickle.dumps(refused.value))
        assert type(again) is AttemptApiError and again.status_code == 403 and str(again) == str(refused.value)
        assert "403" in str(again) and "/restored" in str(again)
        url = f"{api.url}/internal/v1/attempts/{job.id}/2/restored"
        headers = {"Authorization": f"Bearer {mine.token}"}
        for body, field in [
            ({"checkpoint_uri": "/s/x", "step": -1}, "step"),
            ({"checkpoint_uri": ""}, "checkpoint_uri"),
            ({"checkpoint_uri": "/s/x", "complete": "yes"}, "complete"),
            ({"checkpoint_uri": "/s/x", "written_by_attempt": 0}, "written_by_attempt"),
            ({"checkpoint_uri": "/s/x", "extra": 1}, "extra"),
        ]:
            response = httpx.post(url, json=body, headers=headers)
            assert response.status_code == 422, response.text
            assert field in response.text
    assert rows(db, job.id) == [(1, 5, "/s/ck5", True)]


# ---- a real TorchTrainer ---------------------------------------------------------------------------------------


def with_env(config: dict[str, Any], *, env: dict[str, str]) -> None:
    """The train loop of one fit, with the environment the dispatcher gives a Ray Job (Train workers are fresh actor
    processes of this test's Ray cluster, which do not inherit the test's own environment)."""
    from examples.mlp import train_loop
    from workers.train_loop import run_loop

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        run_loop(config, loop=train_loop)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def fit(storage: Path, run_name: str, config: dict[str, Any], env: dict[str, str]) -> Any:
    from ray.train import RunConfig, ScalingConfig

    from workers.lean_trainer import trainer_class

    trainer = trainer_class()(
        functools.partial(with_env, env=env),
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=1, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=run_name, storage_path=str(storage)),
    )
    return trainer.fit()


@pytest.mark.slow
@pytest.mark.usefixtures("ray_connected")
def test_a_resumed_train_loop_lists_the_checkpoint_whose_report_was_lost(tmp_path: Path) -> None:
    db = make_engine(f"sqlite:///{tmp_path / 'shunter.db'}")  # one backend for the Ray part: rows are tested on both
    upgrade(db)
    job = job_on_attempt(db, 2)
    storage, trace = tmp_path / "storage", tmp_path / "trace.txt"
    config = {"checkpoint_every": 2, "trace_path": str(trace)}
    # Attempt 1 trains 4 steps and checkpoints at 2 and 4; none of it reaches shunter (its reports were lost).
    first = fit(storage, job.id, {**config, "total_steps": 4}, {"SHUNTER_ATTEMPT": "1"})
    assert first.error is None, first.error
    assert rows(db, job.id) == []
    with live_api(db, tmp_path, progress_secret=SECRET) as api:
        env = {"SHUNTER_ATTEMPT": "2", "SHUNTER_JOB_ID": job.id, "SHUNTER_PROGRESS_URL": api.url,
               "SHUNTER_ATTEMPT_TOKEN": attempt_tokens.issue(job.id, 2, SECRET)}  # fmt: skip
        second = fit(storage, job.id, {**config, "total_steps": 6}, env)
    assert second.error is None, second.error
    assert [line.split() for line in trace.read_text().splitlines()] == [
        ["1", "1"], ["1", "2"], ["1", "3"], ["1", "4"], ["2", "5"], ["2", "6"],
    ]  # fmt: skip
    # The example writes its own checkpoints (no shunter manifest): its step comes from Ray Train's record, and
    # with no writer named the attempt that restored it lists it.
    [(attempt, step, uri, complete)] = rows(db, job.id)
    assert (attempt, step, complete) == (2, 4, True)
    assert Path(uri).parent == storage / job.id and Path(uri).is_dir()
    assert latest(db, job.id) == uri
    assert restored_events(db, job.id) == [
        (2, f"attempt 2 resumed from {uri} (step 4); its report had not reached shunter, so it is listed now")
    ]
