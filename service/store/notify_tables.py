"""Tables of notifications (issue 18): the delivery outbox and the write-only secrets of jobs' notify entries.

Registered on SQLModel.metadata by `service.store.db` (and the migrations' env), like `service.store.models`.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Column, Index, Text
from sqlmodel import Field, SQLModel

from service.store.models import UTCDateTime, utcnow

PENDING, DELIVERED, FAILED = "pending", "delivered", "failed"


class Notification(SQLModel, table=True):
    """One event to one target. Written with the event, in its transaction (`service.workflows.notifications.enqueue`);
    sent, and retried, by `service.workflows.webhooks`. `body` holds the exact text sent and signed, the same on every
    try."""

    __tablename__ = "notifications"
    __table_args__ = (
        Index("ix_notifications_due", "state", "next_at"),  # the sender's claim: pending rows that are due
        Index("ix_notifications_job", "job_id", "id"),
        Index("ux_notifications_event_target", "event_id", "target", unique=True),
    )

    id: int | None = Field(default=None, primary_key=True)
    event_id: str = Field(max_length=40)  # "evt_<32 hex>": one per state change, shared by all its targets
    job_id: str = Field(foreign_key="jobs.id", max_length=32)
    target: str = Field(max_length=32)  # "job:<i>" (the spec's notify[i]) or "cluster:<i>" (SHUNTER_WEBHOOKS[i])
    url: str = Field(sa_column=Column(Text, nullable=False))
    format: str = Field(default="json", max_length=16)
    to_state: str = Field(max_length=16)
    body: str = Field(sa_column=Column(Text, nullable=False))
    state: str = Field(default=PENDING, max_length=16)  # pending | delivered | failed
    attempts: int = 0
    # When a pending row is due; while a sender holds it, when that claim lapses (a sender killed mid-send).
    next_at: datetime = Field(default_factory=utcnow, sa_column=Column(UTCDateTime(), nullable=False))
    claim_token: str | None = Field(default=None, max_length=32)
    last_status: int | None = None
    last_error: str | None = Field(default=None, sa_column=Column(Text))
    created_at: datetime = Field(default_factory=utcnow, sa_column=Column(UTCDateTime(), nullable=False))
    delivered_at: datetime | None = Field(default=None, sa_column=Column(UTCDateTime()))


class NotifySecret(SQLModel, table=True):
    """The secret of a job's notify[target] entry, kept out of the spec (which the API returns and the job gets)."""

    __tablename__ = "notify_secrets"

    job_id: str = Field(foreign_key="jobs.id", primary_key=True, max_length=32)
    target: int = Field(primary_key=True)
    secret: str = Field(sa_column=Column(Text, nullable=False))
