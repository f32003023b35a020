"""What one API token grants (`SHUNTER_API_TOKENS` maps each token to one): parsed strictly with the settings, so
`"admin": "false"` is a start-up error, not an admin, and an unknown key is an error, not a grant silently ignored.
Who is asking, once a token is known, is `service.tenancy.auth.Caller`."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from service.spec.job import PRIORITY_MAX, PRIORITY_MIN, QUEUE_NAME

# An owner or team name: it is stored on every job and shown in events and listings.
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,127}")


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
