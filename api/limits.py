"""The request body bound (issue 12), below FastAPI, for every route: 413 beyond `Settings.max_body_bytes`.

The bound is enforced while the body is read, not from what the client says: a declared Content-Length over it is
refused before a byte is read, and a body that is longer than declared, or chunked, is cut off by the chunk that
crosses the bound. That chunk never reaches the application, so nothing holds more than the bound.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyTooLarge(Exception):
    """Raised to the application's body reader when the body crosses the bound (the client sees the 413)."""


class BodyLimit:
    """ASGI middleware: `max_bytes` for every HTTP request, or `per_path[prefix]` for paths under that prefix."""

    def __init__(self, app: ASGIApp, *, max_bytes: int, per_path: Mapping[str, int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.per_path = dict(per_path or {})

    def limit_for(self, path: str) -> int:
        for prefix, limit in self.per_path.items():
            if path == prefix or path.startswith(prefix.rstrip("/") + "/"):
                return limit
        return self.max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope["path"])
        if _declared_length(scope) > limit:
            await _refuse(send, limit)
            return
        received = 0
        exceeded = False
        response_started = False

        async def bounded_receive() -> Message:
            nonlocal received, exceeded
            if exceeded:
                raise BodyTooLarge
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    exceeded = True
                    raise BodyTooLarge
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal response_started
            if exceeded:
                return  # whatever the application answers to a cut-off body, the client gets the 413
            response_started = response_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, bounded_receive, guarded_send)
        except Exception:
            if not exceeded:
                raise
        if exceeded and not response_started:
            await _refuse(send, limit)


def _declared_length(scope: Scope) -> int:
    """The largest Content-Length the request declares; 0 when none (or unreadable: the reading still counts)."""
    declared = 0
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length" and value.strip().isdigit():
            declared = max(declared, int(value))
    return declared


async def _refuse(send: Send, limit: int) -> None:
    await refuse(send, 413, "too_large", f"request body is larger than {limit} bytes")


async def refuse(send: Send, status: int, code: str, detail: str, *, retry_after: int | None = None) -> None:
    """Answer a request below the application, its body unread (the body bound here, the gate in api.gate): the
    API's error body, and `Connection: close`, since the rest of the body is never read and this connection cannot
    carry another request."""
    body = json.dumps({"detail": detail, "code": code}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class AttemptRates:
    """Rows each job attempt may write per second through its reports, in this API process: a token bucket per
    attempt, holding at most `burst` and refilled at `per_second` (issue 35: four threads of one job once wrote 6,100
    metric rows a second, and another owner's submit took 40 times as long). N API processes allow N times as much;
    `Settings.attempt_max_rows` is the total, kept in the database. The newest `attempts` attempts are remembered."""

    def __init__(self, attempts: int = 10_000) -> None:
        self._buckets: OrderedDict[tuple[str, int], tuple[float, float]] = OrderedDict()  # key -> (tokens, at)
        self._attempts = attempts
        self._lock = threading.Lock()

    def take(self, key: tuple[str, int], rows: int, *, per_second: float, burst: int) -> float:
        """Take `rows` from the attempt's bucket: 0.0 when taken, else the seconds until they would be (nothing
        taken)."""
        now = time.monotonic()
        with self._lock:
            tokens, at = self._buckets.pop(key, (float(burst), now))
            tokens = min(float(burst), tokens + (now - at) * per_second)
            wait = 0.0 if rows <= tokens else (rows - tokens) / per_second
            self._buckets[key] = (tokens - rows if wait == 0.0 else tokens, now)
            while len(self._buckets) > self._attempts:
                self._buckets.popitem(last=False)
        return wait


def retry_after(seconds: float) -> str:
    """A Retry-After header's whole seconds, never 0."""
    return str(max(1, math.ceil(seconds)))
