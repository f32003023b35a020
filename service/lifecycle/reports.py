"""Progress of a job's attempt, fenced by attempt. The job (its Train controller and driver) sends it to the internal
API with its attempt token (`api/routes/internal.py`), which calls these; a job never holds a database URL.

A write lands only while the job is still on the attempt that reports it and not ended, so a zombie of an old
attempt can never overwrite the progress of the new one. These writes never touch `Job.state`.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any

from sqlalchemy import insert, text, update
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from service.core.errors import ShunterError
from service.lifecycle import node_faults
from service.lifecycle.state import record_event
from service.policy import end_reasons
from service.store import signals
from service.store.db import begin_write
from service.store.models import ACTIVE_STATES, Attempt, Checkpoint, EndReason, EventKind, Job, JobEvent, Metric, utcnow

ROW_CAP_REASON = "attempt_row_cap"
RATE_LIMIT_REASON = "attempt_rate_limited"


class AttemptRowCap(ShunterError):
    """The attempt's reports already wrote `Settings.attempt_max_rows` rows: this one is refused."""

    status_code = 429
    code = ROW_CAP_REASON


def _take_rows(session: Session, *, job_id: str, attempt: int, rows: int, max_rows: int | None) -> bool:
    """Count `rows` more against the attempt's total, in the write's own transaction: False (nothing counted) when that
    would pass `max_rows`. One conditional UPDATE, so API processes writing at once never pass it together. An
    attempt with no row (the dispatcher makes one as it admits the attempt; a job's row alone, as tests and tools
    write it) has nothing to count against."""
    if max_rows is None or rows == 0:
        return True
    this = (col(Attempt.job_id) == job_id, col(Attempt.number) == attempt)
    taken = session.execute(
        update(Attempt).where(*this, col(Attempt.rows_written) + rows <= max_rows)
        .values(rows_written=col(Attempt.rows_written) + rows)
    )  # fmt: skip
    if taken.rowcount:  # type: ignore[attr-defined]  # an UPDATE's result is a CursorResult; Session.execute says Result
        return True
    return session.exec(select(Attempt.id).where(*this)).first() is None


def record_limited(engine: Engine, *, job_id: str, attempt: int, reason: str, message: str) -> bool:
    """Say on the job's timeline, once per attempt and `reason`, that its reports are being refused (a cap or a rate);
    never for an attempt that is no longer current. False when already said, or fenced off."""
    with Session(engine) as session:
        begin_write(session)
        current = session.exec(
            select(Job.id).where(Job.id == job_id, Job.attempt == attempt,
                                 col(Job.state).in_(ACTIVE_STATES))
        ).first()  # fmt: skip
        said = session.exec(
            select(JobEvent.id).where(JobEvent.job_id == job_id, JobEvent.reason == reason,
                                      JobEvent.attempt == attempt).limit(1)
        ).first()  # fmt: skip
        if current is None or said is not None:
            return False
        record_event(session, job_id, kind=EventKind.WARNING, reason=reason, message=message, attempt=attempt)
        session.commit()
    return True


def _over_cap(engine: Engine, *, job_id: str, attempt: int, max_rows: int) -> AttemptRowCap:
    message = (f"this attempt's reports wrote {max_rows} rows (metric points, checkpoints and their events), "
               "the most one attempt may (attempt_max_rows): later reports are refused")  # fmt: skip
    record_limited(engine, job_id=job_id, attempt=attempt, reason=ROW_CAP_REASON, message=message)
    return AttemptRowCap(message)


def _numeric(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(float(value)):
            out[key] = float(value)
    return out


def report_rows(metrics: dict[str, Any], checkpoint_uri: str | None, *, progress: bool = True) -> int:
    """The rows one report writes: a metric row per number other than `step` (none for a report that is not
    progress), and a checkpoint's two (its row and its event). The API's per-attempt rate and the total cap count
    the same rows."""
    numeric = [name for name in _numeric(metrics) if name != "step"] if progress else []
    return len(numeric) + (2 if checkpoint_uri else 0)


_PG_POINTS = text(
    "INSERT INTO metrics (job_id, attempt, step, name, value, at) "
    "SELECT :job_id, :attempt, :step, u.name, u.value, :at "
    "FROM unnest(CAST(:names AS text[]), CAST(:values AS double precision[])) AS u(name, value)"
)


def _insert_points(
    session: Session, *, job_id: str, attempt: int, step: int | None, at: datetime, points: dict[str, float]
) -> None:
    """A report's metric rows in one statement, no ORM object each: as ORM rows, 256 metrics cost the API 76 ms of
    CPU a report, and four threads of one job kept every other owner's requests waiting on it (issue 35). On
    PostgreSQL one INSERT of two arrays; elsewhere the driver's executemany."""
    if not points:
        return
    if session.get_bind().dialect.name == "postgresql":
        session.execute(_PG_POINTS, {"job_id": job_id, "attempt": attempt, "step": step, "at": at,
                                     "names": list(points), "values": [float(v) for v in points.values()]})  # fmt: skip
    else:
        rows = [{"job_id": job_id, "attempt": attempt, "step": step, "name": n, "value": v, "at": at}
                for n, v in points.items()]  # fmt: skip
        session.connection().execute(insert(Metric.__table__), rows)  # type: ignore[attr-defined]  # SQLModel sets __table__ at class creation


def record_report(
    engine: Engine,
    *,
    job_id: str,
    attempt: int,
    metrics: dict[str, Any],
    checkpoint_uri: str | None = None,
    checkpoint_complete: bool = True,
    keep: int | None = None,
    report_index: int = 0,
    progress: bool = True,
    max_rows: int | None = None,
    manifest_sha256: str | None = None,
) -> bool:
    """Store one `ray.train.report` (rank 0's metrics, and the checkpoint if any). False if fenced off; AttemptRowCap
    (nothing stored) when its rows would take the attempt past `max_rows`.

    Only a complete checkpoint becomes the job's latest; with `keep`, older complete ones beyond the newest `keep`
    are marked pruned, as Ray Train's `num_to_keep` deletes them. A report of a checkpoint this attempt already
    recorded is a replay (the driver's final report, a retried send): it sets the progress and adds no rows.
    `progress=False`: a checkpoint only (a script's output folder, sealed by shunter): the job's step and metrics stay
    as the script's own reports left them; `metrics["step"]`, when given, is the checkpoint's step.
    `manifest_sha256`: of the checkpoint's manifest as the reporting attempt sealed it, kept with its row: a resume
    proves the checkpoint by it (`checkpoint_manifest`, workers.proof). A replay never changes it.
    """
    numeric = _numeric(metrics)
    if progress:
        step: int | None = int(metrics["step"]) if isinstance(metrics.get("step"), int | float) else report_index
    else:
        step = int(numeric["step"]) if "step" in numeric else None
        numeric = {}
    now = utcnow()
    with Session(engine) as session:
        begin_write(session)
        current = (col(Job.id) == job_id, col(Job.attempt) == attempt, col(Job.state).in_(ACTIVE_STATES))
        shown = numeric
        if progress and "loss" not in numeric:
            # The job's shown loss is the last one reported: a report without one (an HF Trainer's end-of-training
            # summary) keeps it in `latest_metrics`, instead of the job ending with `loss: null` (issue 35). Only
            # there: no metric row or checkpoint gets a loss its report did not have.
            before = session.exec(select(Job.latest_metrics).where(*current)).first()
            if isinstance(before, dict) and isinstance(before.get("loss"), int | float):
                shown = {**numeric, "loss": before["loss"]}
        values: dict[str, Any] = {"step": step, "latest_metrics": shown, "progress_at": now} if progress else {}
        if checkpoint_uri and checkpoint_complete:
            values["latest_checkpoint"] = checkpoint_uri
        replay = bool(checkpoint_uri) and session.exec(
            select(Checkpoint.id).where(Checkpoint.job_id == job_id, Checkpoint.attempt == attempt,
                                        Checkpoint.uri == checkpoint_uri).limit(1)
        ).first() is not None  # fmt: skip
        if replay and progress and step is not None:
            # A replay never takes the job's progress back: the driver's final report carries the last *checkpointed*
            # report, and the loop may have reported further steps without a checkpoint since.
            ahead = session.exec(select(Job.id).where(*current, col(Job.step) > step)).first() is not None
            if ahead:
                return True
        if values:
            fenced = session.execute(update(Job).where(*current).values(**values)).rowcount != 1  # type: ignore[attr-defined]  # an UPDATE's result is a CursorResult; Session.execute says Result
        else:
            fenced = session.exec(select(Job.id).where(*current)).first() is None
        if fenced:
            session.rollback()
            return False
        if replay:
            session.commit()
            return True
        rows = report_rows(metrics, checkpoint_uri, progress=progress)
        if not _take_rows(session, job_id=job_id, attempt=attempt, rows=rows, max_rows=max_rows):
            session.rollback()
            raise _over_cap(engine, job_id=job_id, attempt=attempt, max_rows=max_rows or 0)
        _insert_points(session, job_id=job_id, attempt=attempt, step=step, at=now,
                       points={name: value for name, value in numeric.items() if name != "step"})  # fmt: skip
        if checkpoint_uri:
            session.add(
                Checkpoint(job_id=job_id, attempt=attempt, step=step, uri=checkpoint_uri, metrics=numeric,
                           complete=checkpoint_complete, manifest_sha256=manifest_sha256, created_at=now)
            )  # fmt: skip
            if keep is not None and checkpoint_complete:
                _mark_pruned(session, job_id=job_id, keep=keep)
            record_event(session, job_id, kind=EventKind.CHECKPOINT, reason="checkpoint_saved", message=checkpoint_uri,
                         attempt=attempt, at=now)  # fmt: skip
        session.commit()
    return True


def checkpoint_manifest(engine: Engine, *, job_id: str, uri: str) -> tuple[bool, str | None]:
    """(whether the job has checkpoint `uri`, the sha256 of its manifest the service recorded when the attempt that
    wrote it reported it). A checkpoint listed from a restore, or reported before hashes were kept, has none: its
    resume checks its files against its own manifest only (workers.proof). Read by the job's attempts only, for their
    own job: what they prove a checkpoint by before loading it, never from the storage they can all write."""
    with Session(engine) as session:
        rows = session.exec(
            select(Checkpoint.manifest_sha256).where(Checkpoint.job_id == job_id, Checkpoint.uri == uri)
            .order_by(col(Checkpoint.id).desc())
        ).all()  # fmt: skip
    return bool(rows), next((h for h in rows if h), None)


def record_started(engine: Engine, *, job_id: str, attempt: int) -> bool:
    """Every rank's train loop (or script process) of this attempt has started: the job is at step 0 until its first
    report, which is what the dispatcher marks RUNNING on. False when fenced off, or a report came first."""
    with Session(engine) as session:
        begin_write(session)
        result = session.execute(
            update(Job)
            .where(col(Job.id) == job_id, col(Job.attempt) == attempt, col(Job.state).in_(ACTIVE_STATES),
                   col(Job.step).is_(None))
            .values(step=0, progress_at=utcnow())
        )  # fmt: skip
        if result.rowcount == 1:  # type: ignore[attr-defined]  # an UPDATE's result is a CursorResult; Session.execute says Result
            signals.publish(session, signals.ADMISSION, job_id)  # its dispatcher marks it RUNNING now
        session.commit()
        return bool(result.rowcount == 1)  # type: ignore[attr-defined]  # an UPDATE's result is a CursorResult; Session.execute says Result


def record_restore(
    engine: Engine,
    *,
    job_id: str,
    attempt: int,
    checkpoint_uri: str,
    step: int | None = None,
    complete: bool = True,
    written_by: int | None = None,
) -> bool:
    """Record that this attempt's train loop restored `checkpoint_uri` (Ray Train's latest of the run), before its
    first step. False when fenced off or already recorded for this attempt.

    A checkpoint shunter does not list yet is listed now (as written by attempt `written_by`, when its manifest says
    so and it is an earlier or this attempt; else by this one) and, when complete, becomes the job's latest: its report
    was lost, e.g. with a Ray head killed between Ray Train's own record of the checkpoint and the report reaching the
    API. Without this the job's checkpoint list would miss the very checkpoint the job went on from.
    """
    now = utcnow()
    with Session(engine) as session:
        begin_write(session)
        job = session.exec(
            select(Job)
            .where(col(Job.id) == job_id, col(Job.attempt) == attempt, col(Job.state).in_(ACTIVE_STATES))
            .with_for_update()
        ).first()
        if job is None:
            return False
        at = f" (step {step})" if step is not None else ""
        message = f"attempt {attempt} resumed from {checkpoint_uri}{at}"
        said = session.exec(
            select(JobEvent.message).where(JobEvent.job_id == job_id, JobEvent.attempt == attempt,
                                           JobEvent.reason == "checkpoint_restored")
        ).all()  # fmt: skip
        if any(m == message or (m or "").startswith(message + ";") for m in said):
            return False  # a restarted worker group restoring the same checkpoint again
        known = session.exec(
            select(Checkpoint.id).where(Checkpoint.job_id == job_id, Checkpoint.uri == checkpoint_uri).limit(1)
        ).first()
        if known is None:
            writer = written_by if written_by is not None and 1 <= written_by <= attempt else attempt
            session.add(Checkpoint(job_id=job_id, attempt=writer, step=step, uri=checkpoint_uri, metrics={},
                                   complete=complete, created_at=now))  # fmt: skip
            if complete:
                job.latest_checkpoint = checkpoint_uri
                session.add(job)
            message += "; its report had not reached shunter, so it is listed now"
        record_event(session, job_id, kind=EventKind.CHECKPOINT, reason="checkpoint_restored", message=message,
                     attempt=attempt, at=now)  # fmt: skip
        session.commit()
    return True


def _mark_pruned(session: Session, *, job_id: str, keep: int) -> None:
    session.flush()
    live = session.exec(
        select(Checkpoint)
        .where(Checkpoint.job_id == job_id, Checkpoint.complete, Checkpoint.pruned == False)  # noqa: E712
        .order_by(col(Checkpoint.id).desc())
    ).all()
    for row in live[keep:]:
        row.pruned = True
        session.add(row)


def record_warning(
    engine: Engine, *, job_id: str, attempt: int, code: str, message: str, max_rows: int | None = None
) -> bool:
    """Tell the user something that did not stop the job: a WARNING event (`code` as its reason) and `message` in
    `Job.warnings`. Fenced by attempt like `record_report`; once per attempt and code (the callback and the driver
    may both notice the same thing), and a message already listed from an earlier attempt is not listed twice.
    False when fenced off or already recorded."""
    with Session(engine) as session:
        begin_write(session)
        job = session.exec(
            select(Job)
            .where(col(Job.id) == job_id, col(Job.attempt) == attempt, col(Job.state).in_(ACTIVE_STATES))
            .with_for_update()
        ).first()
        if job is None:
            return False
        seen = session.exec(
            select(JobEvent.id).where(
                JobEvent.job_id == job_id,
                JobEvent.kind == EventKind.WARNING.value,
                JobEvent.reason == code[:64],
                JobEvent.attempt == attempt,
            )
        ).first()
        if seen is not None:
            return False
        if not _take_rows(session, job_id=job_id, attempt=attempt, rows=1, max_rows=max_rows):
            session.rollback()
            raise _over_cap(engine, job_id=job_id, attempt=attempt, max_rows=max_rows or 0)
        if message not in (job.warnings or []):
            job.warnings = [*(job.warnings or []), message]
            session.add(job)
        record_event(session, job_id, kind=EventKind.WARNING, reason=code, message=message, attempt=attempt)
        session.commit()
    return True


def attempt_reported(engine: Engine, *, job_id: str, attempt: int) -> bool:
    """Whether any report of this attempt left a trace: a metric point or a checkpoint row."""
    with Session(engine) as session:
        for table in (Metric, Checkpoint):
            query = select(table.id).where(table.job_id == job_id, table.attempt == attempt).limit(1)
            if session.exec(query).first() is not None:
                return True
    return False


def record_attempt_end(engine: Engine, *, job_id: str, attempt: int, reason: EndReason, message: str) -> bool:
    """The driver's own account of why its attempt ended, sent once its run's result is final: the dispatcher holding
    the job is woken and ends the attempt on it, without waiting for Ray's teardown. False when the attempt's end was
    already recorded (a stop of the dispatcher's own came first) or it has no row."""
    with Session(engine) as session:
        begin_write(session)
        row = session.exec(select(Attempt).where(Attempt.job_id == job_id, Attempt.number == attempt)).first()
        if row is not None and row.end_reason is None:
            row.end_reason = reason
            row.message = message[-4000:]
            row.driver_ended_at = utcnow()  # the run's result is final: the dispatcher ends the attempt on it
            session.add(row)
            signals.publish(session, signals.ADMISSION, job_id)
            failed = (row.preflight or {}).get("failed") or {}
            node_faults.record(session, job_id=job_id, attempt=attempt, reason=reason, message=message,
                             address=failed.get("address"))  # fmt: skip
            session.commit()
            return True
    return False


def steps_lost(session: Session, job_id: str) -> str:
    """Where the next attempt resumes and what the ended one trained past it: the job's last reported step less the
    step of its newest complete checkpoint (the one a retry resumes from), e.g. "resumes from step 40; 0 steps lost"."""
    job = session.get(Job, job_id)
    last = job.step if job is not None else None
    resume = session.exec(
        select(Checkpoint.step)
        .where(Checkpoint.job_id == job_id, col(Checkpoint.complete), col(Checkpoint.step).is_not(None))
        .order_by(col(Checkpoint.step).desc())
        .limit(1)
    ).first()
    if resume is None:
        return "no checkpoint: resumes from the start" + (f"; {last} steps lost" if last else "")
    return f"resumes from step {resume}; {max(0, (last or 0) - resume)} steps lost"


def node_losses(engine: Engine, job_id: str, attempt_id: int | None, reason: EndReason) -> int:
    """For an attempt ending `reason`: how many earlier attempts of the job drained or lost a node (service.policy.retry
    bounds their free retries). Asked only for those ends: every other one is decided without it, so a database that
    lacks the newer end reasons (not migrated yet) fails no other end."""
    lost = sorted(end_reasons.NODE_ENDS)
    if reason not in lost:
        return 0
    with Session(engine) as session:
        earlier = (Attempt.job_id == job_id, Attempt.id != attempt_id, col(Attempt.end_reason).in_(lost))
        rows = session.exec(select(Attempt.id).where(*earlier)).all()
    return len(rows)
