"""Parsed job specs, kept per process and bounded by bytes (issue 35, item 3).

A stored spec never changes, so the dispatcher and the queue estimate parse each one once. Those caches were bounded
by entries (50,000) alone: 50,000 specs of 1 MiB, which a sweep of large configs can make, are gigabytes of memory.
Each entry here is counted at the size of its stored JSON, and the least recently used go first once the total is
over `max_bytes`. An entry larger than the whole bound is not kept (it is parsed again when asked for). One lock
guards each cache: the dispatcher parses from its reconcile threads, the estimate from request threads and its own.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any, Generic, TypeVar

V = TypeVar("V")
DEFAULT_MAX_BYTES = 64 << 20


def stored_size(spec: Any) -> int:
    """The bytes of a spec as JSON (as the database keeps it), counted once when its parse is kept."""
    return len(json.dumps(spec, separators=(",", ":"), default=str))


class SpecCache(Generic[V]):
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()
        self.bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: Hashable) -> tuple[bool, V | None]:
        """(True, value) when `key` is kept (the value may be None: a spec that does not parse), else (False, None)."""
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return False, None
            self._items.move_to_end(key)
            return True, item[0]

    def put(self, key: Hashable, value: V, size: int) -> None:
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            if size > self.max_bytes:
                return
            self._items[key] = (value, size)
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, (_, dropped) = self._items.popitem(last=False)
                self.bytes -= dropped
