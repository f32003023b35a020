"""Progress reaches shunter through its API, which may be restarting (a `kill -9`, a rolling update): reports wait a
moment, are kept while it is away, and arrive in order once it answers; a replayed checkpoint report adds nothing."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
from ray.train import Checkpoint as RayCheckpoint
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from service.backends.ray_local import free_port
from service.lifecycle.reports import record_report
from service.store.models import Attempt, Checkpoint, EndReason, Job, JobState, Metric
from service.tenancy import attempt_tokens
from tests.conftest import wait_for
from tests.live_api import add_attempt, live_api
from workers.attempt_api import AttemptApi
from workers.context import FINISHED_METRIC
from workers.progress import OUTBOX, ProgressCallback

SECRET = "delivery-test-key-" + "k" * 24
SPEC = {"entrypoint": {"callable": "examples.mlp:train_loop"}}


def running_job(db: Engine) -> Job:
    job = Job(name="j", spec=SPEC, state=JobState.RUNNING, attempt=1)
    add_attempt(db, job)
    return job


def steps(db: Engine, job_id: str) -> list[int | None]:
    with Session(db) as session:
        rows = session.exec(
            select(Metric).where(Metric.job_id == job_id, Metric.name == "loss").order_by(col(Metric.id))
        )
        return [m.step for m in rows]


def test_reports_are_kept_while_the_api_is_away_and_arrive_in_order(db: Engine, tmp_path: Path) -> None:
    job = running_job(db)
    port = free_port()  # nothing listens yet: the API is down
    token = attempt_tokens.issue(job.id, 1, SECRET)
    callback = ProgressCallback(api=AttemptApi(f"http://127.0.0.1:{port}", token, job.id, 1), keep=3)
    callback.after_report(None, [{"step": 1, "loss": 1.0}], None)
    callback.after_report(None, [{"step": 2, "loss": 0.5}], None)
    assert len(callback._outbox) == 2 and steps(db, job.id) == []
    with live_api(db, tmp_path, port=port, progress_secret=SECRET):
        callback.after_report(None, [{"step": 3, "loss": 0.25}], None)
        # Each try is bounded by the client's 5 s timeout, which an API on a loaded machine can miss (seen once: the
        # reports were kept, as they must be); later reports try again, as the next tries here do.
        wait_for(lambda: callback._deliver() or not callback._outbox, timeout=120, what="the kept reports delivered")
    assert callback._outbox == []
    assert steps(db, job.id) == [1, 2, 3]
    with Session(db) as session:
        assert session.get(Job, job.id).step == 3  # type: ignore[union-attr]


def test_the_outbox_is_bounded_and_keeps_checkpoint_reports(db: Engine) -> None:
    job = running_job(db)
    api = AttemptApi(f"http://127.0.0.1:{free_port()}", attempt_tokens.issue(job.id, 1, SECRET), job.id, 1)
    callback = ProgressCallback(api=api, keep=3)
    callback._outbox = [api.report_body({"loss": 1.0}, step=i, checkpoint_uri="/c/1" if i == 0 else None)
                        for i in range(OUTBOX + 5)]  # fmt: skip
    callback._deliver()  # the API is away: nothing sent, the oldest plain reports dropped
    assert len(callback._outbox) == OUTBOX
    assert callback._outbox[0]["checkpoint_uri"] == "/c/1" and callback._outbox[-1]["step"] == OUTBOX + 4


def test_a_replayed_checkpoint_report_adds_no_rows(db: Engine) -> None:
    job = running_job(db)
    for _ in range(2):  # the Train callback's report, then the driver's final one
        assert record_report(db, job_id=job.id, attempt=1, metrics={"step": 20, "loss": 0.1}, checkpoint_uri="/c/20")
    with Session(db) as session:
        assert len(session.exec(select(Checkpoint).where(Checkpoint.job_id == job.id)).all()) == 1
        assert session.get(Job, job.id).latest_checkpoint == "/c/20"  # type: ignore[union-attr]
    assert steps(db, job.id) == [20]


def test_a_replay_never_takes_the_jobs_progress_back(db: Engine) -> None:
    job = running_job(db)
    assert record_report(db, job_id=job.id, attempt=1, metrics={"step": 20, "loss": 0.1}, checkpoint_uri="/c/20")
    assert record_report(db, job_id=job.id, attempt=1, metrics={"step": 23, "loss": 0.05})  # no checkpoint since
    # The driver's final report is the last *checkpointed* one (Ray Train's Result.metrics): step 20 again.
    assert record_report(db, job_id=job.id, attempt=1, metrics={"step": 20, "loss": 0.1}, checkpoint_uri="/c/20")
    with Session(db) as session:
        job_now = session.get(Job, job.id)
        assert job_now is not None and job_now.step == 23 and job_now.latest_metrics == {"step": 23, "loss": 0.05}
    assert steps(db, job.id) == [20, 23]


def test_the_end_of_training_is_recorded_after_every_report_before_it(db: Engine, tmp_path: Path) -> None:
    """The report every rank makes once its loop returned (FINISHED_METRIC) ends the attempt SUCCEEDED from the Train
    callback, after the reports kept while the API was away: the last checkpoint is listed before the success."""
    job = running_job(db)
    port = free_port()  # the API is away for the loop's last reports
    callback = ProgressCallback(api=AttemptApi(f"http://127.0.0.1:{port}", attempt_tokens.issue(job.id, 1, SECRET),
                                               job.id, 1), keep=3)  # fmt: skip
    callback.after_report(None, [{"step": 1, "loss": 1.0}], None)
    callback.after_report(None, [{"step": 2, "loss": 0.5}], _checkpoint(tmp_path / "c2"))
    assert len(callback._outbox) == 2
    with live_api(db, tmp_path, port=port, progress_secret=SECRET):
        callback.after_report(None, [{FINISHED_METRIC: 1}, {FINISHED_METRIC: 1}], None)
    assert callback._outbox == []
    with Session(db) as session:
        attempt = session.exec(select(Attempt).where(Attempt.job_id == job.id)).one()
        assert attempt.end_reason is EndReason.SUCCEEDED and attempt.driver_ended_at is not None
        checkpoint = session.exec(select(Checkpoint).where(Checkpoint.job_id == job.id)).one()
        assert checkpoint.step == 2 and checkpoint.created_at <= attempt.driver_ended_at
        job_now = session.get(Job, job.id)
        assert job_now is not None and job_now.step == 2 and FINISHED_METRIC not in (job_now.latest_metrics or {})
    assert steps(db, job.id) == [1, 2]  # the end is no report of the job's


def test_the_end_of_training_is_left_to_the_driver_while_reports_are_kept(db: Engine) -> None:
    job = running_job(db)
    callback = ProgressCallback(api=AttemptApi(f"http://127.0.0.1:{free_port()}",
                                               attempt_tokens.issue(job.id, 1, SECRET), job.id, 1), keep=3)  # fmt: skip
    callback.after_report(None, [{"step": 1, "loss": 1.0}], None)
    callback.after_report(None, [{FINISHED_METRIC: 1}], None)  # still away: the report stays kept, no end is sent
    assert [b["step"] for b in callback._outbox] == [1]
    with Session(db) as session:
        assert session.exec(select(Attempt).where(Attempt.job_id == job.id)).one().end_reason is None


def _checkpoint(path: Path) -> RayCheckpoint:
    path.mkdir(parents=True)
    (path / "state.pt").write_bytes(b"weights")
    return RayCheckpoint(path=str(path))


def test_news_sent_in_the_background_is_sent_before_the_last_word() -> None:
    """Rank 0 sends its pre-flight result and 'started' from a sender thread; before the run's finished report (whose
    end would fence them off) it waits until they are sent."""
    import time

    from workers.attempt_api import in_background, sent_in_background

    api = AttemptApi(f"http://127.0.0.1:{free_port()}", "token", "job", 1)
    sent: list[str] = []
    in_background(api, lambda a: (time.sleep(0.3), sent.append("preflight")), "a slow one")
    in_background(api, lambda a: sent.append("started"), "the next")
    sent_in_background(timeout=30)
    assert sent == ["preflight", "started"]


@pytest.mark.parametrize("db", ["sqlite"], indirect=True)  # the wait is the driver's: one database shows it
def test_an_attempt_waits_for_its_spec_while_the_api_restarts(db: Engine, tmp_path: Path) -> None:
    """A driver starting while the API is down (a `kill -9` and restart, which took more than 7.5 s on the loaded
    machine: test_faults' kill test once failed a job so) waits for its spec rather than failing its job."""
    job = running_job(db)
    port = free_port()
    api = AttemptApi(f"http://127.0.0.1:{port}", attempt_tokens.issue(job.id, 1, SECRET), job.id, 1)
    up, done = threading.Event(), threading.Event()

    def restart_later() -> None:
        time.sleep(8.0)  # the API is away for longer than the old five tries (7.5 s) waited
        with live_api(db, tmp_path, port=port, progress_secret=SECRET):
            up.set()
            done.wait(60)

    restarting = threading.Thread(target=restart_later, daemon=True)
    restarting.start()
    try:
        started = time.monotonic()
        assert api.spec()["entrypoint"] == SPEC["entrypoint"]
        assert up.is_set() and time.monotonic() - started >= 8.0
    finally:
        done.set()
        restarting.join(30)
    with pytest.raises(httpx.ConnectError):  # with no patience it says the API is away at once, as before
        api.spec(patience=0)
