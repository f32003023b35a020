"""API tokens: one strict schema for what a token grants (issue 12).

`SHUNTER_API_TOKENS` maps each token to a `TokenInfo`. Parsing is strict: `"admin": "false"` is a start-up error, not
an admin (`bool("false")` is true), and an unknown key is an error, not a grant silently ignored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from service.errors import Forbidden
from service.spec import PRIORITY_MAX, PRIORITY_MIN, QUEUE_NAME

if TYPE_CHECKING:
    from service.models import Job

# An owner or team name: it is stored on every job and shown in events and listings.
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,127}")


@dataclass(frozen=True)
class Caller:
    """Who is asking: jobs are visible to their owner, and to admins."""

    owner: str = "anonymous"
    admin: bool = True
    team: str | None = None
    queues: tuple[str, ...] | None = None  # the queues a non-admin may submit to; None: any
    max_priority: int | None = None  # the highest priority a non-admin may ask for; None: any

    def may_see(self, job: Job) -> bool:
        return self.admin or job.owner == self.owner


class TokenInfo(BaseModel):
    """What one API token grants. Without `admin`, a caller sees and acts on its own jobs only."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    owner: str = Field(description="the jobs this token submits are this owner's")
    admin: StrictBool = Field(False, description="sees and acts on every job; changes queues; no submit limits")
    team: str | None = Field(None, description="the owner's team (for fair share between teams)")
    queues: list[str] | None = Field(None, description="the queues it may submit to; null: any queue")
    max_priority: int | None = Field(
        None, ge=PRIORITY_MIN, le=PRIORITY_MAX, description="the highest priority it may ask for; null: any"
    )

    @field_validator("owner", "team")
    @classmethod
    def _safe_name(cls, value: str | None) -> str | None:
        if value is not None and not SAFE_NAME.fullmatch(value):
            raise ValueError(
                f"{value!r}: use 1-128 letters, digits, '.', '_', '@' or '-', starting with a letter or digit"
            )
        return value

    @field_validator("queues")
    @classmethod
    def _queue_names(cls, value: list[str] | None) -> list[str] | None:
        for name in value or ():
            if not QUEUE_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not a queue name (lowercase letters, digits, '_' or '-')")
        return value


def check_submit(caller: Caller, *, queue: str, priority: int) -> None:
    """A non-admin caller may queue a job (submit or retry) only in its own queues and up to its priority; 403."""
    if caller.admin:
        return
    if caller.queues is not None and queue not in caller.queues:
        allowed = ", ".join(caller.queues) or "none"
        raise Forbidden(f"queue: {caller.owner!r} may not use queue {queue!r}; allowed: {allowed}", field="queue")
    if caller.max_priority is not None and priority > caller.max_priority:
        raise Forbidden(
            f"priority: {priority} is above {caller.owner!r}'s maximum of {caller.max_priority}", field="priority"
        )
