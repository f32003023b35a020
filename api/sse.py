"""Server-Sent Events over the durable event table: poll SQL, send what is new, resume from `Last-Event-ID`.

A stream holds no database connection between polls (each poll is a short session of its own), ends by itself at
its deadline (`api.streams`), and rides out a database outage: a poll that cannot reach the database sends nothing
and the next one tries again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from sqlalchemy.engine import Engine
from sqlmodel import Session

from api.schemas import STREAM_ERROR_RESPONSES, EventPublic
from api.streams import DB_UNAVAILABLE, BoundedStream, is_database_outage, open_stream
from service import jobs
from service.jobs import Caller
from service.models import Job, JobEvent, JobState
from service.settings import Settings

log = logging.getLogger(__name__)

POLL_SECONDS = 0.5
KEEPALIVE_SECONDS = 15.0
BATCH = 500
# One event of the stream, as Open API 3.2 describes text/event-stream items (and as FastAPI writes its own):
# `data` is the EventPublic JSON, `id` its event id. `retry:` and keepalive comments carry no data.
SSE_ITEM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {
            "type": "string",
            "contentMediaType": "application/json",
            "contentSchema": {"$ref": "#/components/schemas/EventPublic"},
        },
        "event": {"type": "string"},
        "id": {"type": "string", "pattern": "^[0-9]+$"},
        "retry": {"type": "integer", "minimum": 0},
    },
}
# For the OpenAPI schema of the endpoints that stream with `follow=true`.
SSE_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "JSON history, or with `follow=true` a text/event-stream of the same events",
        "content": {"text/event-stream": {"itemSchema": SSE_ITEM_SCHEMA}},
    },
    **STREAM_ERROR_RESPONSES,
}


def format_event(event: JobEvent) -> str:
    """One SSE message: `id` is the event id (a client resumes with `Last-Event-ID`), `data` the EventPublic JSON."""
    return f"id: {event.id}\ndata: {EventPublic.model_validate(event).model_dump_json()}\n\n"


def _job_batch(engine: Engine, job_id: str, after: int) -> tuple[bool, list[JobEvent]]:
    """(ended, new events). The job's state is read first: if it has ended, its terminal event is in the batch."""
    with Session(engine, expire_on_commit=False) as session:
        job = session.get(Job, job_id)
        if job is None:
            return True, []
        ended = JobState(job.state).is_terminal
        rows = jobs.events(session, job, after_id=after)
    return ended, rows


def _all_batch(engine: Engine, caller: Caller, after: int) -> tuple[bool, list[JobEvent]]:
    with Session(engine, expire_on_commit=False) as session:
        return False, jobs.visible_events(session, caller=caller, after_id=after, limit=BATCH)


async def pause(deadline: float, seconds: float) -> bool:
    """Sleep `seconds`, or until the deadline; False once the deadline has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        return False
    await asyncio.sleep(min(seconds, left))
    return time.monotonic() < deadline


async def _stream(
    engine: Engine, *, caller: Caller, job_id: str | None, after: int, deadline: float
) -> AsyncIterator[str]:
    last = after
    sent_at = time.monotonic()
    yield "retry: 2000\n\n"  # how long an EventSource waits before it reconnects (with Last-Event-ID)
    while True:
        try:
            if job_id is not None:
                ended, rows = await asyncio.to_thread(_job_batch, engine, job_id, last)
            else:
                ended, rows = await asyncio.to_thread(_all_batch, engine, caller, last)
        except DB_UNAVAILABLE as exc:
            if not is_database_outage(exc):
                raise
            log.warning("event stream: the database does not answer; trying again", exc_info=True)
            ended, rows = False, []
        for event in rows:
            yield format_event(event)
            last = int(event.id or last)
            sent_at = time.monotonic()
        if ended:
            return
        if len(rows) >= BATCH and time.monotonic() < deadline:
            continue  # catching up: no pause
        if time.monotonic() - sent_at >= KEEPALIVE_SECONDS:
            yield ": keepalive\n\n"  # keeps proxies from closing an idle stream
            sent_at = time.monotonic()
        if not await pause(deadline, POLL_SECONDS):
            return


def event_stream(
    app: FastAPI,
    engine: Engine,
    settings: Settings,
    *,
    caller: Caller,
    job_id: str | None,
    after: int,
    timeout_seconds: float | None,
) -> BoundedStream:
    """A `text/event-stream` of events after `after`; a job's stream ends after its terminal event, any stream at
    its deadline. Takes one of the caller's stream slots (429 when none is left)."""
    return open_stream(
        app,
        caller,
        settings,
        lambda deadline: _stream(engine, caller=caller, job_id=job_id, after=after, deadline=deadline),
        timeout_seconds=timeout_seconds,
        media_type="text/event-stream",
    )
