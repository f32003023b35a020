"""A fair gate in front of the API (issue 35): no caller's flood slows another caller's requests.

Every HTTP request but the probes passes the gate. At most `capacity` requests compute at once in this process; a
request that finds them all taken waits, without a thread, a database session or a read of its body, and the next
free place goes to the waiting caller with the fewest requests computing, then the one served least recently, then
the earliest request. The last free place is kept for a caller with nothing computing: a caller's burst takes the
places nobody else wants, and a quiet tenant's request finds a place at once, whatever a flood holds open (measured
in `bench/flood.py`). A caller may have at most
`waiting_per_caller` requests waiting (429 beyond, at once), and none waits longer than `max_wait_seconds` (503).

A caller is the owner its credential speaks for: a user token's owner, or the owner signed into a job's attempt token
(so mallory's API calls and her jobs' reports are one caller, not one per credential). Any other credential is its
own caller (kept as a hash, never as the token), and a request without one is its client's address.

A request that goes on to wait for something other than the CPU (a follow stream, a read of a log that is still
being written) steps aside first (`step_aside`): it gives its place back, and from then on counts only against the
caller's stream slots (`api.streams`). A place is therefore held for computing, never for waiting.

Every answer that passed the gate says how long it waited for its place, then how long it took to its first byte:
`Server-Timing: gate;dur=<ms>, app;dur=<ms>`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import threading
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.limits import refuse

SCOPE_KEY = "shunter.gate"  # the request's place, in its ASGI scope
EXEMPT_PATHS = frozenset({"/healthz", "/readyz"})  # the probes: cheap, and never to be queued behind a flood


def caller_key(scope: Scope, owner_of: Callable[[str], str | None] | None = None) -> str:
    """Who a request is, for the gate: the owner its credential speaks for (`owner_of`: a user token's, or an attempt
    token's, so a tenant and its jobs are one caller however many credentials they hold), else a hash of the
    credential, else its client's address."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            if owner_of is not None:
                scheme, _, presented = value.decode("latin-1").partition(" ")
                owner = owner_of(presented.strip()) if scheme.lower() == "bearer" else None
                if owner is not None:
                    return "o:" + owner
            return "t:" + hashlib.sha256(value).hexdigest()[:32]
    client = scope.get("client")
    return "a:" + (client[0] if client else "?")


@dataclass(eq=False)
class _Waiter:
    key: str
    seq: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]
    granted: bool = False


@dataclass(eq=False)
class Place:
    """A request's place in the gate; `release` gives it back (idempotent, from any thread)."""

    gate: Gate
    key: str
    released: bool = field(default=False)

    def release(self) -> None:
        self.gate._release(self)


class Full(Exception):
    """The caller already has `waiting_per_caller` requests waiting."""


class Late(Exception):
    """The request waited `max_wait_seconds` without getting a place."""


class Gate:
    """The scheduling state (thread-safe: a sync route releases from its worker thread)."""

    def __init__(self, *, capacity: int, waiting_per_caller: int, max_wait_seconds: float) -> None:
        self.capacity = capacity
        self.waiting_per_caller = waiting_per_caller
        self.max_wait_seconds = max_wait_seconds
        self._lock = threading.Lock()
        self._computing: Counter[str] = Counter()
        self._total = 0
        self._queues: dict[str, deque[_Waiter]] = {}
        self._seq = itertools.count()
        self._turns = itertools.count()
        self._served: dict[str, int] = {}  # a caller's last turn, while it has requests computing or waiting
        self.refused_full = 0
        self.refused_late = 0

    def computing(self, key: str | None = None) -> int:
        with self._lock:
            return self._total if key is None else self._computing[key]

    def waiting(self, key: str | None = None) -> int:
        with self._lock:
            if key is None:
                return sum(len(q) for q in self._queues.values())
            return len(self._queues.get(key, ()))

    async def enter(self, key: str) -> Place:
        """A place for `key`'s request: at once when one is free and nobody waits, else the next one that is fair.
        Raises `Full` or `Late`."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if not self._queues and self._may_take(key):
                self._take(key)
                return Place(self, key)
            queue = self._queues.setdefault(key, deque())
            if len(queue) >= self.waiting_per_caller:
                self.refused_full += 1
                raise Full
            waiter = _Waiter(key, next(self._seq), loop, loop.create_future())
            queue.append(waiter)
            self._grant_locked()  # a place may be free (a queue of others' requests being served)
        try:
            # The shield keeps the waiter's own future from being cancelled: a grant is never lost.
            await _within(asyncio.shield(waiter.future), self.max_wait_seconds)
        except BaseException as exc:
            with self._lock:
                if not waiter.granted:
                    self._forget_locked(waiter)
                    if isinstance(exc, TimeoutError):
                        self.refused_late += 1
                        raise Late from None
                    raise
            if not isinstance(exc, TimeoutError):  # granted, then cancelled (the client left): give it on
                self._release(Place(self, key))
                raise
        return Place(self, key)

    def _may_take(self, key: str) -> bool:
        """A free place, and not the last one unless `key` has nothing computing: the last place is kept for a caller
        that shows up while others are busy, so that it does not wait for one of theirs to end."""
        free = self.capacity - self._total
        return free > 1 or (free == 1 and self._computing[key] == 0)

    def _take(self, key: str) -> None:
        self._computing[key] += 1
        self._total += 1
        self._served[key] = next(self._turns)

    def _forget_locked(self, waiter: _Waiter) -> None:
        queue = self._queues.get(waiter.key)
        if queue is not None:
            with contextlib.suppress(ValueError):  # granted meanwhile: no longer in it
                queue.remove(waiter)
            if not queue:
                del self._queues[waiter.key]
                if not self._computing[waiter.key]:
                    self._served.pop(waiter.key, None)  # idle: forgotten, as in `_release`

    def _release(self, place: Place) -> None:
        with self._lock:
            if place.released:
                return
            place.released = True
            self._computing[place.key] -= 1
            if self._computing[place.key] <= 0:
                del self._computing[place.key]
                if place.key not in self._queues:
                    self._served.pop(place.key, None)  # idle: forgotten (memory stays bounded by the active callers)
            self._total -= 1
            self._grant_locked()

    def _grant_locked(self) -> None:
        """Hand free places to waiting callers: the one computing least first, then the one served least recently
        (turn by turn), then the earliest request."""
        while self._queues:
            key = min(self._queues, key=lambda k: (self._computing[k], self._served.get(k, -1), self._queues[k][0].seq))
            if not self._may_take(key):
                return  # nor may anyone after it: it computes least
            queue = self._queues[key]
            waiter = queue.popleft()
            if not queue:
                del self._queues[key]
            waiter.granted = True
            self._take(key)
            if _running_loop() is waiter.loop:
                _resolve(waiter.future)
            else:  # a sync route's worker thread gave its place back (step_aside)
                waiter.loop.call_soon_threadsafe(_resolve, waiter.future)


async def _within(awaitable: Awaitable[None], seconds: float) -> None:
    """`await awaitable`, TimeoutError after `seconds`. Not `wait_for` where `asyncio.timeout` exists (3.11): wait_for
    returns a result that came in as the task was cancelled, swallowing the cancel."""
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(seconds):
            await awaitable
        return
    try:
        await asyncio.wait_for(awaitable, seconds)
    except asyncio.TimeoutError:  # a class of its own before 3.11
        raise TimeoutError from None


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class FairGate:
    """ASGI middleware: the gate for every HTTP request but `exempt` paths (see the module docstring)."""

    def __init__(self, app: ASGIApp, *, gate: Gate, exempt: Iterable[str] = EXEMPT_PATHS,
                 owner_of: Callable[[str], str | None] | None = None) -> None:  # fmt: skip
        self.app = app
        self.gate = gate
        self.exempt = frozenset(exempt)
        self.owner_of = owner_of

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.exempt:
            await self.app(scope, receive, send)
            return
        key = caller_key(scope, self.owner_of)
        arrived = time.perf_counter()
        try:
            place = await self.gate.enter(key)
        except Full:
            await refuse(send, 429, "too_many_requests", f"this caller already has {self.gate.waiting_per_caller} "
                          "requests waiting for the API in this process; retry after 1s", retry_after=1)  # fmt: skip
            return
        except Late:
            await refuse(send, 503, "unavailable", f"no place for this request in {self.gate.max_wait_seconds:.0f}s; "
                          "the API is busy, try again", retry_after=5)  # fmt: skip
            return
        scope[SCOPE_KEY] = place
        placed = time.perf_counter()

        async def timed_send(message: Message) -> None:
            if message["type"] == "http.response.start":  # its wait for a place, then its work (Server-Timing)
                timing = f"gate;dur={(placed - arrived) * 1e3:.1f}, app;dur={(time.perf_counter() - placed) * 1e3:.1f}"
                message = {**message, "headers": [*message.get("headers", ()), (b"server-timing", timing.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            place.release()


def step_aside(scope_or_request: Scope | Request) -> None:
    """Give the request's place back before it waits on something other than the CPU (see the module docstring). A
    no-op for a request that holds none (an app without the gate)."""
    scope = scope_or_request.scope if isinstance(scope_or_request, Request) else scope_or_request
    place = scope.get(SCOPE_KEY)
    if isinstance(place, Place):
        place.release()
