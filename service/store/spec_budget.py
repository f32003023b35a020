"""An owner's bytes of specs in jobs that have not ended (issue 35, item 3: byte budgets wherever a spec is multiplied).

Each job stores its spec's size (`Job.spec_bytes`, the compact JSON's length). The jobs of one owner that have not
ended (queued, waiting on dependencies, retrying, running) may hold at most `max_queued_spec_bytes_per_owner` of them
together. A submission that would go over is refused with a 429 naming its field (`spec`; `base` for a sweep): the
same request is accepted once some of those jobs have ended, so it is a "come back later", not a request too large
to ever take (413). The total is one SUM over the owner's rows of `ix_jobs_owner_state_spec_bytes`, read from the
index alone. It is not taken under a lock: submissions of one owner at the same moment may pass it together, by a
spec each (the API's body bound).
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func
from sqlmodel import Session, col, select

from service.config.settings import Settings
from service.core.errors import ShunterError
from service.store.db import base_engine
from service.store.models import TERMINAL_STATES, Job, JobState

NOT_ENDED = sorted(s.value for s in JobState if s not in TERMINAL_STATES)


class SpecBudgetExceeded(ShunterError):
    status_code = 429
    code = "spec_budget"


def held(session: Session, owner: str) -> int:
    """The bytes of specs `owner`'s jobs that have not ended hold. On PostgreSQL, read on a connection of its own when
    the session has no transaction yet: a plain submission stays one statement
    (`service.lifecycle.jobs._insert_with_event`)."""
    query = select(func.coalesce(func.sum(Job.spec_bytes), 0)).where(Job.owner == owner, col(Job.state).in_(NOT_ENDED))
    bind = session.get_bind()
    if bind.dialect.name == "postgresql" and not session.in_transaction():
        with base_engine(bind).connect() as conn:
            return int(conn.execution_options(isolation_level="AUTOCOMMIT").execute(query).scalar_one() or 0)
    return int(session.exec(query).one() or 0)


@dataclass
class Tally:
    """What an owner holds, counted once and added to as a request makes its jobs (a sweep's members)."""

    owner: str
    held: int
    limit: int
    field: str  # what a refusal names

    @classmethod
    def read(cls, session: Session, settings: Settings, *, owner: str, field: str) -> Tally:
        return cls(owner=owner, held=held(session, owner), limit=settings.max_queued_spec_bytes_per_owner, field=field)

    def check(self, adding: int, *, what: str = "this spec") -> None:
        """Raise SpecBudgetExceeded when `adding` more bytes would take the owner over the limit."""
        if self.held + adding > self.limit:
            raise SpecBudgetExceeded(
                f"{self.field}: {what} ({adding:,} bytes) would take the specs of your jobs that have not ended to "
                f"{self.held + adding:,} bytes, over this service's max_queued_spec_bytes_per_owner ({self.limit:,}); "
                "submit again once some of them have ended",
                field=self.field,
            )

    def add(self, size: int) -> None:
        self.check(size)
        self.held += size
