"""GET /v1/jobs/{id}/notifications: how the job's webhook deliveries stand (service.workflows.notifications,
service.workflows.webhooks)."""

from __future__ import annotations

from datetime import datetime
from urllib.parse import urlsplit

from fastapi import APIRouter
from pydantic import BaseModel, Field

from api.deps import CallerDep, SessionDep
from api.routes.jobs import JobId
from api.schemas import ERROR_RESPONSES
from service.lifecycle import jobs
from service.store.notify_tables import Notification
from service.workflows import notifications as notify

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=ERROR_RESPONSES)


class NotificationPublic(BaseModel):
    """One event to one target. Never its secret; a cluster target's URL (which may carry a token, as Slack's do)
    only to admins, anyone else sees its scheme and host."""

    id: int
    event_id: str = Field(description="stable across retries: what receivers de-duplicate on")
    target: str = Field(description='"job:<i>" (the spec\'s notify[i]) or "cluster:<i>" (SHUNTER_WEBHOOKS[i])')
    url: str
    format: str
    to_state: str
    state: str = Field(description="pending | delivered | failed")
    attempts: int
    next_at: datetime | None = Field(description="when a pending one is tried next")
    last_status: int | None = None
    last_error: str | None = None
    created_at: datetime
    delivered_at: datetime | None = None


def to_public(row: Notification, *, admin: bool) -> NotificationPublic:
    url = row.url
    if row.target.startswith("cluster:") and not admin:
        parts = urlsplit(url)
        url = f"{parts.scheme}://{parts.hostname}/..."
    assert row.id is not None
    return NotificationPublic(
        id=row.id, event_id=row.event_id, target=row.target, url=url, format=row.format, to_state=row.to_state,
        state=row.state, attempts=row.attempts, next_at=row.next_at if row.state == "pending" else None,
        last_status=row.last_status, last_error=row.last_error, created_at=row.created_at,
        delivered_at=row.delivered_at,
    )  # fmt: skip


@router.get("/{job_id}/notifications", response_model=list[NotificationPublic])
def job_notifications(job_id: JobId, session: SessionDep, caller: CallerDep) -> list[NotificationPublic]:
    """Every webhook delivery of the job's state changes, oldest first: pending, delivered, or failed (and why)."""
    job = jobs.get(session, job_id, caller=caller)
    return [to_public(row, admin=caller.admin) for row in notify.of_job(session, job)]
