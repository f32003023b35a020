"""Attempts that ended on their driver's word while their Ray Job was still exiting: their logs, kept once it has.

An attempt whose driver said its run ended (`service.lifecycle.reports.record_attempt_end`) is ended at once; its Ray
Job goes on for seconds (Ray Train's teardown, the driver's exit), and its log is only whole once that is over. Each
tick the dispatcher asks Ray about the attempts it ended that way; one Ray calls ended (or no longer knows) has its log
copied out by range, a chunk at a time (`HostFiles.keep_log_chunks`), and its Ray status written on the attempt, which
is what marks it done. A Ray Job still running `linger_seconds` after its driver's last word is stopped: the code is the
job's own, and what it does after saying it is done (a hung teardown, or a loop that never exits) must not hold the
cluster's room unseen. A Ray Job that ends FAILED after its attempt succeeded (the teardown failed) is told as an event;
the success stands.

A dispatcher that restarts picks up such attempts ended in the last hour (whichever dispatcher ended them): keeping a
log twice writes the same file.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import update
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from service.core.errors import InfraError
from service.core.masking import NOTHING, Masker
from service.dispatch.host_files import HostFault, HostFiles
from service.lifecycle.state import record_event
from service.store.db import session_scope
from service.store.models import Attempt, EndReason, EventKind, utcnow

log = logging.getLogger(__name__)
PICK_UP_SECONDS = 3600.0  # on start: attempts ended by their driver this recently whose Ray Job was not seen end
GONE = "GONE"  # the Ray status written when Ray no longer knows the job (its log went with it)


@dataclass
class Pending:
    attempt_id: int
    job_id: str
    number: int
    submission_id: str
    ended_at: datetime
    stop_sent: bool = False


class LateLogs:
    def __init__(self, *, engine: Engine, ray: Any, files: HostFiles, owner: str, linger_seconds: float,
                 mask: Callable[[str], Masker] = lambda _job: NOTHING) -> None:  # fmt: skip
        self.engine, self.ray, self.files, self.owner, self.mask = engine, ray, files, owner, mask
        self.linger_seconds = linger_seconds
        self.pending: dict[int, Pending] = {}

    def add(self, attempt: Attempt, ended_at: datetime) -> None:
        if attempt.id is not None:
            self.pending[attempt.id] = Pending(attempt.id, attempt.job_id, attempt.number, attempt.submission_id,
                                               ended_at)  # fmt: skip

    def pick_up(self, now: datetime | None = None) -> None:
        """Attempts ended by their driver's word lately whose Ray Job was not seen end (a dispatcher died meanwhile)."""
        since = (now or utcnow()) - timedelta(seconds=PICK_UP_SECONDS)
        with Session(self.engine) as session:
            rows = session.exec(
                select(Attempt).where(col(Attempt.ended_at) > since, col(Attempt.driver_ended_at).is_not(None),
                                      col(Attempt.ray_status).is_(None)).limit(10_000)
            ).all()  # fmt: skip
        for row in rows:
            if row.id not in self.pending and row.ended_at is not None:
                self.add(row, row.ended_at)

    def step(self, run: Callable[[Callable[[Pending], None], Iterable[Pending]], Any] = map) -> None:
        """Look at every pending attempt once (`run`: how to map over them, e.g. a thread pool's `map`)."""
        list(run(self._look_safely, list(self.pending.values())))

    def _look_safely(self, item: Pending) -> None:
        try:
            self._look(item)
        except Exception:  # noqa: BLE001 - Ray or the database away: looked at again next tick
            log.warning("job %s: its ended attempt's Ray Job could not be checked this tick", item.job_id,
                        exc_info=True)  # fmt: skip

    def _look(self, item: Pending) -> None:
        info = self.ray.info(item.submission_id)
        if info is not None and not info.is_terminal:
            lingered = (utcnow() - item.ended_at).total_seconds()
            if lingered >= self.linger_seconds and not item.stop_sent:
                self.ray.stop(item.submission_id)
                item.stop_sent = True
                with session_scope(self.engine) as session:
                    record_event(session, item.job_id, kind=EventKind.RAY, reason="ray_job_lingered",
                                 attempt=item.number, actor=self.owner,
                                 message=f"its Ray Job was still running {lingered:.0f}s after the driver said the run "
                                         f"ended (linger_seconds={self.linger_seconds:g}): stopped")  # fmt: skip
            return
        log_uri = None
        if info is not None:
            try:
                chunks = self.ray.log_stream(item.submission_id, 0, None)  # by range: one chunk held at a time
                if chunks is not None:  # kept with the job's secret values starred out
                    masked = self.mask(item.job_id).stream(chunks)
                    log_uri = self.files.keep_log_chunks(item.job_id, item.number, masked)
            except (InfraError, HostFault) as exc:
                log.warning("job %s: could not keep the log of attempt %d: %s", item.job_id, item.number, exc)
        with session_scope(self.engine) as session:
            values: dict[str, Any] = {"ray_status": info.status[:16] if info is not None else GONE}
            if log_uri is not None:
                values["log_uri"] = log_uri
            unmarked = (col(Attempt.id) == item.attempt_id, col(Attempt.ray_status).is_(None))
            marked = session.execute(update(Attempt).where(*unmarked).values(**values)).rowcount == 1  # type: ignore[attr-defined]  # an UPDATE's result is a CursorResult; Session.execute says Result
            if marked and info is not None and info.status == "FAILED" and not item.stop_sent:
                ended = session.get(Attempt, item.attempt_id)
                if ended is not None and ended.end_reason is EndReason.SUCCEEDED:
                    # The run's result stands: what failed came after every rank's loop returned and the attempt
                    # succeeded on it (Ray Train's teardown, the driver's exit). Told, never turned into a failure.
                    record_event(session, item.job_id, kind=EventKind.RAY, reason="ray_teardown_failed",
                                 attempt=item.number, actor=self.owner,
                                 message="its Ray Job ended FAILED after the run had succeeded (Ray Train's "
                                         "teardown, the driver's exit): the job stays SUCCEEDED")  # fmt: skip
        self.pending.pop(item.attempt_id, None)
