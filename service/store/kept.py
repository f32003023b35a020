"""A value read from the database that many requests of one process share for a moment: read again once it is
`seconds` old (or when asked to), kept per engine, weakly, so an engine's value goes with the engine."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

from sqlalchemy.engine import Engine
from sqlmodel import Session

from service.store.db import base_engine

T = TypeVar("T")


class KeptPerEngine(Generic[T]):
    def __init__(self, seconds: float, read: Callable[[Session], T]) -> None:
        self.seconds, self.read = seconds, read
        self._kept: weakref.WeakKeyDictionary[Engine, tuple[float, T]] = weakref.WeakKeyDictionary()

    def get(self, session: Session, *, fresh: bool = False) -> T:
        engine = base_engine(session.get_bind())
        kept, now = self._kept.get(engine), time.monotonic()
        if kept is not None and not fresh and now - kept[0] < self.seconds:
            return kept[1]
        value = self.read(session)
        self._kept[engine] = (now, value)
        return value
