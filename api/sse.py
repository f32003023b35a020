"""Server-Sent Events over the durable event table: poll SQL, send what is new, resume from `Last-Event-ID`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse
from sqlalchemy.engine import Engine
from sqlmodel import Session

from api.schemas import EventPublic
from service import jobs
from service.jobs import Caller
from service.models import Job, JobEvent, JobState

POLL_SECONDS = 0.5
KEEPALIVE_SECONDS = 15.0
BATCH = 500
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# For the OpenAPI schema of the endpoints that stream with `follow=true`.
SSE_RESPONSE = {200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}}}


def format_event(event: JobEvent) -> str:
    """One SSE message: `id` is the event id (a client resumes with `Last-Event-ID`), `data` the EventPublic JSON."""
    return f"id: {event.id}\ndata: {EventPublic.model_validate(event).model_dump_json()}\n\n"


def _job_batch(engine: Engine, job_id: str, after: int) -> tuple[bool, list[JobEvent]]:
    """(ended, new events). The job's state is read first: if it has ended, its terminal event is in the batch."""
    with Session(engine) as session:
        job = session.get(Job, job_id)
        if job is None:
            return True, []
        ended = JobState(job.state).is_terminal
        rows = jobs.events(session, job, after_id=after)
    return ended, rows


def _all_batch(engine: Engine, caller: Caller, after: int) -> tuple[bool, list[JobEvent]]:
    with Session(engine) as session:
        return False, jobs.visible_events(session, caller=caller, after_id=after, limit=BATCH)


async def _stream(
    engine: Engine, *, caller: Caller, job_id: str | None, after: int, timeout_seconds: float | None
) -> AsyncIterator[str]:
    last = after
    deadline = time.monotonic() + timeout_seconds if timeout_seconds else None
    sent_at = time.monotonic()
    yield "retry: 2000\n\n"  # how long an EventSource waits before it reconnects (with Last-Event-ID)
    while True:
        if job_id is not None:
            ended, rows = await asyncio.to_thread(_job_batch, engine, job_id, last)
        else:
            ended, rows = await asyncio.to_thread(_all_batch, engine, caller, last)
        for event in rows:
            yield format_event(event)
            last = int(event.id or last)
            sent_at = time.monotonic()
        if ended:
            return
        if len(rows) >= BATCH:
            continue  # catching up: no pause
        if deadline is not None and time.monotonic() >= deadline:
            return
        if time.monotonic() - sent_at >= KEEPALIVE_SECONDS:
            yield ": keepalive\n\n"  # keeps proxies from closing an idle stream
            sent_at = time.monotonic()
        await asyncio.sleep(POLL_SECONDS)


def event_stream(
    engine: Engine, *, caller: Caller, job_id: str | None, after: int, timeout_seconds: float | None
) -> StreamingResponse:
    """A `text/event-stream` of events after `after`; a job's stream ends after its terminal event."""
    body = _stream(engine, caller=caller, job_id=job_id, after=after, timeout_seconds=timeout_seconds)
    return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
