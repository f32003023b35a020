"""Listing cursors: a row's (created_at, id), the order every listing pages in (newest first), opaque to clients."""

from __future__ import annotations

import base64
from datetime import datetime
from typing import Protocol

from service.core.errors import InvalidSpec


class Paged(Protocol):
    created_at: datetime
    id: str


def encode(row: Paged) -> str:
    return base64.urlsafe_b64encode(f"{row.created_at.isoformat()}|{row.id}".encode()).decode()


def decode(cursor: str) -> tuple[datetime, str]:
    """The (created_at, id) a cursor this API returned stands for; anything else is a 422 naming `cursor`."""
    try:
        created, _, row_id = base64.urlsafe_b64decode(cursor.encode()).decode().partition("|")
        return datetime.fromisoformat(created), row_id
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidSpec("cursor: not a cursor this API returned", field="cursor") from exc
