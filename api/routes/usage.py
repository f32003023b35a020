"""/v1/usage: CPU- and GPU-hours, ended jobs and queue waits over a time window (`service.tenancy.usage` does the
counting).

The window is `[since, until)`, ISO-8601 times; a time without a zone is UTC. Without tokens everyone is an admin;
with them a non-admin sees only their own usage.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import BeforeValidator

from api.deps import CallerDep, SessionDep
from api.schemas import ERROR_RESPONSES, UsagePublic
from service.core.errors import InvalidSpec
from service.store.models import utcnow
from service.tenancy import usage

DEFAULT_WINDOW = timedelta(days=7)
ISO_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
router = APIRouter(prefix="/v1/usage", tags=["usage"], responses=ERROR_RESPONSES)


def _iso_only(value: Any) -> Any:
    """pydantic reads a number ("0.5") as Unix seconds; the API takes ISO-8601 only, as its schema says."""
    if isinstance(value, str) and not ISO_DATE.match(value):
        raise ValueError("not an ISO-8601 date and time, e.g. 2025-03-03T00:00:00Z")
    return value


Instant = Annotated[datetime | None, BeforeValidator(_iso_only)]
Since = Annotated[Instant, Query(description="window start, ISO-8601 (no zone: UTC); default: until - 7 days")]
Until = Annotated[Instant, Query(description="window end (excluded), ISO-8601 (no zone: UTC); default: now")]


@router.get("", response_model=UsagePublic)
def get_usage(
    session: SessionDep,
    caller: CallerDep,
    owner: Annotated[str | None, Query(max_length=128, description="one owner (non-admins: only their own)")] = None,
    team: Annotated[str | None, Query(max_length=128)] = None,
    queue: Annotated[str | None, Query(max_length=64)] = None,
    since: Since = None,
    until: Until = None,
) -> UsagePublic:
    """Resources held by attempts in the window (running ones up to now) by owner, team and queue, with totals;
    jobs that ended in it by end state; queue-wait percentiles of the jobs whose first attempt started in it."""
    now = utcnow()
    end = now if until is None else _utc(until, "until")
    start = _shifted(end, -DEFAULT_WINDOW, "until") if since is None else _utc(since, "since")
    report = usage.report(
        session, owner=usage.visible_owner(caller, owner), team=team, queue=queue, since=start, until=end, now=now
    )
    return UsagePublic.model_validate(report)


def _utc(value: datetime, field: str) -> datetime:
    aware = value if value.tzinfo is not None else value.replace(tzinfo=timezone.utc)
    return _shifted(aware, timedelta(0), field)


def _shifted(value: datetime, by: timedelta, field: str) -> datetime:
    """`value + by` in UTC; a time at the calendar's edge that cannot move is the caller's error (422), not a 500."""
    try:
        return (value + by).astimezone(timezone.utc)
    except OverflowError as exc:
        raise InvalidSpec(f"{field}: {value.isoformat()} is out of range", field=field) from exc
