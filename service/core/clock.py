"""The service's clock: every time the service stamps or compares goes through `now()` (via `models.utcnow`).

By default it is the wall clock. A simulation (bench/fairshare_sim.py) installs a `VirtualClock` with `use(...)`, so
the real dispatchers, admission and progress code run through hours of cluster time in seconds, and what they write
(created_at, started_at, leases, fair-share usage) is in that time. One clock per process: the dispatchers' threads
all see the one installed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Protocol


class Clock(Protocol):
    def now(self) -> datetime: ...


class VirtualClock:
    """A clock that moves only when told (`set`, `advance`); aware UTC, safe to read from any thread."""

    def __init__(self, start: datetime) -> None:
        self._lock = threading.Lock()
        self._now = _aware(start)

    def now(self) -> datetime:
        with self._lock:
            return self._now

    def set(self, when: datetime) -> None:
        """Move to `when`; never backwards (time read by the service must not run back)."""
        when = _aware(when)
        with self._lock:
            if when < self._now:
                raise ValueError(f"the clock cannot go back from {self._now.isoformat()} to {when.isoformat()}")
            self._now = when

    def advance(self, seconds: float) -> datetime:
        """Move forward by `seconds`; returns the new time."""
        if seconds < 0:
            raise ValueError(f"the clock cannot go back ({seconds} s)")
        with self._lock:
            self._now += timedelta(seconds=seconds)
            return self._now


_installed: Clock | None = None
_install_lock = threading.Lock()


def now() -> datetime:
    """The current time, aware UTC: the installed clock's, else the wall clock's."""
    clock = _installed
    return clock.now() if clock is not None else datetime.now(timezone.utc)


@contextmanager
def use(clock: Clock) -> Iterator[Clock]:
    """Make `clock` the process's clock for the block (then restore the one before)."""
    global _installed
    with _install_lock:
        previous, _installed = _installed, clock
    try:
        yield clock
    finally:
        with _install_lock:
            _installed = previous


def _aware(when: datetime) -> datetime:
    return when.replace(tzinfo=timezone.utc) if when.tzinfo is None else when.astimezone(timezone.utc)
