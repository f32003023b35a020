"""Bounds on follow streams (issue 12): how many one caller may hold open, and how long any may last.

A follow stream (`?follow=true` on job logs, job events and `/v1/events`) holds no database connection between its
polls: each poll opens a short session of its own (the request's own session is closed before the stream starts,
see `api.deps.get_session`). What a stream does hold is a slot: at most `Settings.max_streams_per_caller` per caller
in each API process (the count is per process: N API processes behind a balancer allow N times as many), 429 with
`Retry-After` beyond. Every stream ends by itself after `Settings.stream_max_seconds` (or the caller's shorter
`timeout_seconds`); a client that wants more reconnects, resuming with `Last-Event-ID` or a log `offset`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from sqlalchemy import exc as sa_exc
from starlette.types import Receive, Scope, Send

from api.gate import step_aside
from service.config.settings import Settings
from service.core.errors import ShunterError
from service.tenancy.auth import Caller

RETRY_AFTER_SECONDS = 5
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# What a database that cannot be reached (down, dropped, restarting, its pool exhausted) raises. A stream's poll
# that meets one sends nothing and tries again; a request answers 503 (see `is_database_outage`).
DB_UNAVAILABLE: tuple[type[Exception], ...] = (
    sa_exc.OperationalError,
    sa_exc.InterfaceError,
    sa_exc.TimeoutError,
    sa_exc.DisconnectionError,
)
# SQLite reports its own bugs-in-the-caller as OperationalError too: those stay 500s.
_SQLITE_NOT_AN_OUTAGE = ("no such ", "syntax error", "has no column", "already exists")


def is_database_outage(exc: BaseException) -> bool:
    """Whether `exc` says the database cannot be reached now (503, try again), not that a statement is wrong."""
    if isinstance(exc, sa_exc.DBAPIError):
        if exc.connection_invalidated:
            return True
        if not isinstance(exc, sa_exc.OperationalError | sa_exc.InterfaceError):
            return False  # IntegrityError, ProgrammingError, DataError: the statement, not the database
        if not type(exc.orig).__module__.startswith("sqlite3"):
            return True
        return not any(m in str(exc.orig).lower() for m in _SQLITE_NOT_AN_OUTAGE)
    return isinstance(exc, DB_UNAVAILABLE)


class TooManyStreams(ShunterError):
    status_code = 429
    code = "too_many_streams"
    headers = {"Retry-After": str(RETRY_AFTER_SECONDS)}


class Slot:
    """One open stream of one caller; `release` is idempotent (the response and the body may both call it)."""

    def __init__(self, slots: StreamSlots, owner: str) -> None:
        self._slots = slots
        self._owner = owner
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._slots._release(self._owner)


class StreamSlots:
    """Open follow streams per caller, in this process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, int] = {}

    def acquire(self, owner: str, cap: int) -> Slot:
        with self._lock:
            held = self._open.get(owner, 0)
            if held >= cap:
                raise TooManyStreams(
                    f"{owner} already holds {held} follow streams (at most {cap} per caller in this API process); "
                    f"close one or retry after {RETRY_AFTER_SECONDS}s"
                )
            self._open[owner] = held + 1
        return Slot(self, owner)

    def _release(self, owner: str) -> None:
        with self._lock:
            left = self._open.get(owner, 0) - 1
            if left > 0:
                self._open[owner] = left
            else:
                self._open.pop(owner, None)

    def held(self, owner: str) -> int:
        with self._lock:
            return self._open.get(owner, 0)


_create_lock = threading.Lock()


def state_of(app: FastAPI, name: str, factory: Callable[[], Any]) -> Any:
    """A per-app (so per-process, and separate for each app a test builds) object, made on first use."""
    value = getattr(app.state, name, None)
    if value is None:
        with _create_lock:
            value = getattr(app.state, name, None)
            if value is None:
                value = factory()
                setattr(app.state, name, value)
    return value


def slots_of(app: FastAPI) -> StreamSlots:
    return state_of(app, "stream_slots", StreamSlots)


async def _released_at_end(body: AsyncIterator[str | bytes], slot: Slot) -> AsyncIterator[str | bytes]:
    try:
        async for chunk in body:
            yield chunk
    finally:
        slot.release()


class BoundedStream(StreamingResponse):
    """A StreamingResponse that gives its slot back however the stream ends (done, timed out, client gone)."""

    def __init__(self, content: AsyncIterator[str | bytes], *, slot: Slot, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._slot = slot

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        step_aside(scope)  # from here it waits on news, not the CPU: its place in the gate goes to others
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._slot.release()


def open_stream(
    app: FastAPI,
    caller: Caller,
    settings: Settings,
    body: Callable[[float], AsyncIterator[str | bytes]],
    *,
    timeout_seconds: float | None,
    media_type: str,
    headers: dict[str, str] | None = None,
) -> BoundedStream:
    """Take one of the caller's stream slots (429 if none is left) and stream `body(deadline)`; the body must end
    by the monotonic `deadline`: `stream_max_seconds`, or the caller's shorter `timeout_seconds`."""
    slot = slots_of(app).acquire(caller.owner, settings.max_streams_per_caller)
    try:
        limit = min(timeout_seconds, settings.stream_max_seconds) if timeout_seconds else settings.stream_max_seconds
        return BoundedStream(
            _released_at_end(body(time.monotonic() + limit), slot),
            slot=slot,
            media_type=media_type,
            headers={**STREAM_HEADERS, **(headers or {})},
        )
    except BaseException:
        slot.release()
        raise
