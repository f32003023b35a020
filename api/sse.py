"""Server-Sent Events over the durable event table: read what is new, send it, resume from `Last-Event-ID`.

A stream reads the table when it is told there is news: every write of an event says so (`service.store.signals`,
channel `events`, its payload the job's id). On PostgreSQL that comes through LISTEN/NOTIFY from any process, on one
listening connection per API process (`service.store.signals.Hub`), fanned out here to the streams that care
(`Followers`: a job's stream hears its own job, `/v1/events` any); a slow safety read (`SAFETY_POLL_SECONDS`) covers a
lost notification. Without a connected listener (SQLite, or PostgreSQL while the listener reconnects) a stream reads
every `POLL_SECONDS` as well, and still hears at once what this process wrote (`serve`: the dispatcher's events).

A stream holds no database connection between reads (each is a short session of its own), ends by itself at its
deadline (`api.streams`), and rides out a database outage: a read that cannot reach the database sends nothing and
the next one tries again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from sqlalchemy.engine import Engine
from sqlmodel import Session

from api.schemas import STREAM_ERROR_RESPONSES, EventPublic
from api.streams import DB_UNAVAILABLE, BoundedStream, is_database_outage, open_stream
from service.config.settings import Settings
from service.lifecycle import jobs
from service.store import signals
from service.store.models import Job, JobEvent, JobState
from service.tenancy.auth import Caller

log = logging.getLogger(__name__)

POLL_SECONDS = 0.5  # between reads without a connected PostgreSQL listener
SAFETY_POLL_SECONDS = 10.0  # between reads with one: only a notification lost to a reconnect waits this long
READ_SPACING_SECONDS = 0.1  # a stream reads at most this often, however many notifications come
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


class Waiter:
    """One stream's wake-up: set from the hub's thread, awaited on the stream's event loop."""

    def __init__(self, followers: Followers, job_id: str | None) -> None:
        self.followers, self.job_id = followers, job_id
        self.loop = asyncio.get_running_loop()
        self.news = asyncio.Event()

    def tell(self) -> None:  # any thread
        self.loop.call_soon_threadsafe(self.news.set)

    async def pause(self, deadline: float, seconds: float) -> bool:
        """Until news, `seconds`, or the deadline; False once the deadline has passed."""
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.news.wait(), timeout=min(seconds, left))
        return time.monotonic() < deadline

    def close(self) -> None:
        self.followers.leave(self)


class Followers:
    """This process's event streams of one database, by the job they follow (None: every job the caller sees), and
    the one hub subscription they share while any is open."""

    def __init__(self, engine: Engine) -> None:
        self.hub = signals.hub_for(engine)
        self._lock = threading.Lock()
        self._waiting: dict[str | None, set[Waiter]] = {}
        self._unsubscribe: Any = None

    def join(self, job_id: str | None) -> Waiter:
        waiter = Waiter(self, job_id)
        with self._lock:
            self._waiting.setdefault(job_id, set()).add(waiter)
            if self._unsubscribe is None:
                self._unsubscribe = self.hub.subscribe(signals.EVENTS, self._heard)
        return waiter

    def leave(self, waiter: Waiter) -> None:
        with self._lock:
            group = self._waiting.get(waiter.job_id)
            if group is not None:
                group.discard(waiter)
                if not group:
                    del self._waiting[waiter.job_id]
            if not self._waiting and self._unsubscribe is not None:
                self._unsubscribe()  # the last stream closed: the hub's listener may end
                self._unsubscribe = None

    def _heard(self, job_id: str) -> None:
        """A payload said on `events` (a job's id; "" after a listener reconnect: everyone reads again)."""
        with self._lock:
            if job_id:
                told = [*self._waiting.get(job_id, ()), *self._waiting.get(None, ())]
            else:
                told = [w for group in self._waiting.values() for w in group]
        for waiter in told:
            waiter.tell()

    @property
    def listening(self) -> bool:
        """Whether notifications from every process arrive now (a connected PostgreSQL listener)."""
        return self.hub.cross_process


_followers: dict[int, Followers] = {}
_followers_lock = threading.Lock()


def followers_for(engine: Engine) -> Followers:
    with _followers_lock:
        found = _followers.get(id(engine))
        if found is None or found.hub is not signals.hub_for(engine):
            found = _followers[id(engine)] = Followers(engine)
        return found


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
    waiter = followers_for(engine).join(job_id)  # before the first read: news written after it wakes the next
    try:
        yield "retry: 2000\n\n"  # how long an EventSource waits before it reconnects (with Last-Event-ID)
        while True:
            waiter.news.clear()  # news from here on wakes the pause below, even news that comes during this read
            read_at = time.monotonic()
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
            wait = SAFETY_POLL_SECONDS if waiter.followers.listening else POLL_SECONDS
            keepalive_in = KEEPALIVE_SECONDS - (time.monotonic() - sent_at)
            if not await waiter.pause(deadline, max(0.0, min(wait, keepalive_in))):
                return
            spacing = read_at + READ_SPACING_SECONDS - time.monotonic()
            if spacing > 0 and not await pause(deadline, spacing):  # a burst of news: one read for all of it
                return
    finally:
        waiter.close()


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
