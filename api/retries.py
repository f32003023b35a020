"""When the SDK tries a request again (`api.client.Client`, `api.async_client.AsyncClient`): only what is safe to
repeat (a GET, or a POST that carries an `Idempotency-Key`, which the clients set on every submit), and only after
a transient failure: no connection, a timeout, or the server's 429 / 502 / 503 / 504 (its `Retry-After` is
honoured). Backoff is exponential with jitter (tenacity), `RETRIES` more tries at most."""

from __future__ import annotations

from typing import Any

import httpx
from tenacity import RetryCallState, retry_if_exception, stop_after_attempt, wait_exponential_jitter

RETRIES = 3
TRANSIENT_STATUS = frozenset({429, 502, 503, 504})
MAX_WAIT_SECONDS = 10.0


def repeatable(method: str, headers: Any) -> bool:
    return method.upper() in ("GET", "HEAD") or bool(headers and "Idempotency-Key" in headers)


def transient(exc: BaseException) -> bool:
    """No connection or a timeout (httpx's transport errors), or an answer (`api.client.ApiError`, known here by its
    `status_code`) of 429, 502, 503 or 504."""
    if isinstance(exc, httpx.TransportError):
        return True
    return getattr(exc, "status_code", None) in TRANSIENT_STATUS


_backoff = wait_exponential_jitter(initial=0.25, max=4.0)


def _wait(state: RetryCallState) -> float:
    """Exponential with jitter, or the server's Retry-After when it asks for longer (at most MAX_WAIT_SECONDS)."""
    exc = state.outcome.exception() if state.outcome is not None else None
    asked = getattr(exc, "retry_after", None) or 0.0
    return min(max(_backoff(state), asked), MAX_WAIT_SECONDS)


def policy(retries: int) -> dict[str, Any]:
    """tenacity's arguments for `Retrying` / `AsyncRetrying`."""
    return {"stop": stop_after_attempt(retries + 1), "wait": _wait, "retry": retry_if_exception(transient),
            "reraise": True}  # fmt: skip
