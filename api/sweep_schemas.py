"""Response bodies of /v1/sweeps (the request is `service.spec.sweep.SweepRequest`)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field

from service.spec.sweep import SweepMetric


class SweepMember(BaseModel):
    index: int
    job_id: str
    name: str
    values: dict[str, Any] = Field(description="what this member's spec has filled in, key as given -> value")
    state: str
    state_reason: str | None = None
    end_reason: str | None = None
    step: int | None = None
    metric: float | None = Field(None, description="the last value it reported of the sweep's metric")
    best_metric: float | None = Field(None, description="the best value it ever reported of it (by the mode)")
    rank: int | None = Field(None, description="1 = best; null: it has not reported the metric")


class SweepSummary(BaseModel):
    id: str
    name: str
    owner: str
    team: str | None = None
    size: int = Field(description="members")
    max_parallel: int | None = None
    metric: SweepMetric | None = None
    counts: dict[str, int] = Field(description="members by state")
    done: bool = Field(description="every member has ended")
    created_at: datetime
    cancelled_at: datetime | None = None


class SweepPublic(SweepSummary):
    grid: dict[str, list[Any]] | None = None
    points: list[dict[str, Any]] | None = None
    count: int | None = None
    members: list[SweepMember] = Field(description="in index order")
    best: SweepMember | None = Field(
        None,
        description="the member whose last reported metric is best (lowest for min, highest for max) among those "
        "not FAILED or CANCELLED; while members run, the leader so far; null before any reported it",
    )


class SweepList(BaseModel):
    items: list[SweepSummary]
    next_cursor: str | None = None


class SweepCancelled(BaseModel):
    id: str
    cancelled: list[str] = Field(description="the members asked to cancel (those that had not ended)")
    detail: str
