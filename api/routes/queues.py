"""/v1/queues: named queues, their limits and what each runs now."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from api.deps import CallerDep, SessionDep, SettingsDep
from api.schemas import ERROR_RESPONSES
from service import queues
from service.errors import Forbidden
from service.numbers import NoBoolNumbers
from service.scheduler import QueueLimit


class QueueLimits(NoBoolNumbers):
    model_config = ConfigDict(extra="forbid")

    # Bounded so every value fits the database's columns (a 64-bit count answered 500 on SQLite).
    max_running: int | None = Field(None, ge=0, le=1_000_000, description="jobs admitted at once")
    max_cpus: float | None = Field(None, ge=0, le=1e9, allow_inf_nan=False)
    max_gpus: float | None = Field(None, ge=0, le=1e9, allow_inf_nan=False)
    preemption: StrictBool = Field(False, description="may its jobs preempt lower-priority running jobs")


class QueuePublic(BaseModel):
    name: str
    limits: QueueLimits
    running: int
    queued: int
    cpus_in_use: float
    gpus_in_use: float


router = APIRouter(prefix="/v1/queues", tags=["queues"], responses=ERROR_RESPONSES)
QueueName = Annotated[str, Path(pattern=r"^[a-z0-9][a-z0-9_-]{0,63}$")]


@router.get("", response_model=list[QueuePublic])
def list_queues(session: SessionDep, settings: SettingsDep, caller: CallerDep) -> list[QueuePublic]:
    """Every queue: its limits, running and queued jobs, resources in use."""
    return [
        QueuePublic(name=v.name, limits=QueueLimits(**v.limits), running=v.running, queued=v.queued,
                    cpus_in_use=v.cpus_in_use, gpus_in_use=v.gpus_in_use)
        for v in queues.overview(session, settings)
    ]  # fmt: skip


@router.put("/{name}", response_model=QueuePublic)
def put_queue(
    name: QueueName, limits: QueueLimits, session: SessionDep, settings: SettingsDep, caller: CallerDep
) -> QueuePublic:
    """Create a queue or change its limits (admins only when tokens are configured)."""
    if not caller.admin:
        raise Forbidden("only an admin may change queues")
    queues.put(session, name, QueueLimit(**limits.model_dump()))
    session.commit()
    view = next(v for v in queues.overview(session, settings) if v.name == name)
    return QueuePublic(name=view.name, limits=QueueLimits(**view.limits), running=view.running, queued=view.queued,
                       cpus_in_use=view.cpus_in_use, gpus_in_use=view.gpus_in_use)  # fmt: skip
