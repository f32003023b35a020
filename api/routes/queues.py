"""/v1/queues: named queues, their limits and what each runs now."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StringConstraints

from api.deps import CallerDep, SessionDep, SettingsDep
from api.schemas import ERROR_RESPONSES
from service.core.errors import Forbidden
from service.core.numbers import NoBoolNumbers
from service.lifecycle import queues
from service.policy.quotas import QueueLimit, Quota
from service.store import signals
from service.tenancy.auth import Caller

AcceleratorType = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]
GpuCount = Annotated[float, Field(ge=0, le=1e9, allow_inf_nan=False, strict=True)]


class QuotaBody(NoBoolNumbers):
    """Caps for each owner (or team) within the queue; null: no cap."""

    model_config = ConfigDict(extra="forbid")

    max_running: int | None = Field(None, ge=0, le=1_000_000)
    max_cpus: float | None = Field(None, ge=0, le=1e9, allow_inf_nan=False)
    max_gpus: float | None = Field(None, ge=0, le=1e9, allow_inf_nan=False)
    # Keys are not constrained in the schema (OpenAPI tools ignore `propertyNames`): a name no job asks for is a cap
    # that never applies, not an error.
    max_gpus_by_type: dict[str, GpuCount] | None = Field(
        None, max_length=64, description='GPUs held by jobs asking for each accelerator type, e.g. {"H100": 8}'
    )
    max_gpu_hours: float | None = Field(None, ge=0, le=1e9, allow_inf_nan=False)
    window_hours: float = Field(168.0, gt=0, le=24 * 366, allow_inf_nan=False)


class BorrowingLimit(NoBoolNumbers):
    model_config = ConfigDict(extra="forbid")

    cpus: float | None = Field(None, ge=0, le=1e9, allow_inf_nan=False)
    gpus: float | None = Field(None, ge=0, le=1e9, allow_inf_nan=False)


class QueueLimits(NoBoolNumbers):
    model_config = ConfigDict(extra="forbid")

    # Bounded so every value fits the database's columns (a 64-bit count answered 500 on SQLite).
    max_running: int | None = Field(None, ge=0, le=1_000_000, description="jobs admitted at once")
    max_cpus: float | None = Field(None, ge=0, le=1e9, allow_inf_nan=False, description="nominal CPU quota")
    max_gpus: float | None = Field(None, ge=0, le=1e9, allow_inf_nan=False, description="nominal GPU quota")
    preemption: StrictBool = Field(False, description="may its jobs preempt lower-priority running jobs")
    owner_quota: QuotaBody | None = Field(None, description="caps for each owner within this queue")
    team_quota: QuotaBody | None = Field(None, description="caps for each team within this queue")
    cohort: str | None = Field(None, pattern=r"^[a-z0-9][a-z0-9_-]{0,63}$", description="lends/borrows idle quota")
    borrowing_limit: BorrowingLimit | None = Field(None, description="most it may borrow from its cohort")
    accelerator_types: list[AcceleratorType] | None = Field(
        None, min_length=1, max_length=64, description="its jobs must ask for one of these accelerator types"
    )

    def to_limit(self) -> QueueLimit:
        values = self.model_dump()
        for key in ("owner_quota", "team_quota"):
            values[key] = Quota(**values[key]) if values[key] else None
        values["borrowing_limit"] = {k: v for k, v in (values["borrowing_limit"] or {}).items() if v is not None}
        return QueueLimit(**values)


class OwnerShare(BaseModel):
    owner: str
    team: str | None
    running: int
    queued: int
    cpus_in_use: float
    gpus_in_use: float
    usage: float = Field(description="decayed weighted resource-seconds, cluster-wide (fair share)")
    share: float = Field(description="this owner's part of all owners' usage, 0..1")
    weight: float


class QueuePublic(BaseModel):
    name: str
    limits: QueueLimits
    running: int
    queued: int
    cpus_in_use: float
    gpus_in_use: float
    owners: list[OwnerShare] = Field(
        default_factory=list,
        description="who runs or waits here, with fair share (every owner for an admin, else the caller's own)",
    )


router = APIRouter(prefix="/v1/queues", tags=["queues"], responses=ERROR_RESPONSES)
QueueName = Annotated[str, Path(pattern=r"^[a-z0-9][a-z0-9_-]{0,63}$")]


@router.get("", response_model=list[QueuePublic])
def list_queues(session: SessionDep, settings: SettingsDep, caller: CallerDep) -> list[QueuePublic]:
    """Every queue: its limits, running and queued jobs, resources in use; per owner, running and queued jobs and fair
    share (an admin sees every owner, anyone else only their own: another owner's usage is theirs)."""
    return [_public(v, caller) for v in queues.overview(session, settings)]


@router.put("/{name}", response_model=QueuePublic)
def put_queue(
    name: QueueName, limits: QueueLimits, session: SessionDep, settings: SettingsDep, caller: CallerDep
) -> QueuePublic:
    """Create a queue or change its limits (admins only when tokens are configured)."""
    if not caller.admin:
        raise Forbidden("only an admin may change queues")
    queues.put(session, name, limits.to_limit())
    signals.publish(session, signals.ADMISSION)  # new limits may let queued jobs start
    session.commit()
    return _public(next(v for v in queues.overview(session, settings) if v.name == name), caller)


def _public(view: queues.QueueView, caller: Caller) -> QueuePublic:
    owners = [OwnerShare(**o) for o in view.owners if caller.admin or o["owner"] == caller.owner]
    return QueuePublic(name=view.name, limits=QueueLimits(**view.limits), running=view.running, queued=view.queued,
                       cpus_in_use=view.cpus_in_use, gpus_in_use=view.gpus_in_use, owners=owners)  # fmt: skip
