"""Reading attempt logs in bounded memory: byte ranges and tails of shunter's stored copy (read with seek, never
whole), and one shared fetch of a running attempt's Ray log per poll interval, however many followers ask.

Offsets are bytes of the UTF-8 log. The stored copy of an ended attempt is the text Ray last returned, so an offset
taken while the attempt ran still points at the same place once it has ended.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from service.errors import InfraError

CHUNK = 64 * 1024
# `tail` never reads back further than this from the end: a log without newlines cannot make a tail scan it whole.
TAIL_SCAN_MAX = 64 << 20
# What one poll of a followed stored copy reads at most before yielding (the rest follows at once).
FOLLOW_READ_MAX = 1 << 20


def tail_offset(read: Callable[[int, int], bytes], size: int, lines: int, *, floor: int = 0) -> int:
    """The byte offset where the last `lines` lines of [floor, size) start. A final newline ends the last line; it
    does not start another. `read(pos, n)` returns bytes [pos, pos + n); it is called for one CHUNK at a time."""
    lower = max(floor, size - TAIL_SCAN_MAX, 0)
    if size <= lower:
        return size
    end = size - 1 if read(size - 1, 1) == b"\n" else size
    found = 0
    pos = end
    while pos > lower:
        start = max(lower, pos - CHUNK)
        block = read(start, pos - start)
        hi = len(block)
        while (i := block.rfind(b"\n", 0, hi)) >= 0:
            found += 1
            if found == lines:
                return start + i + 1
            hi = i
        pos = start
    return lower


def byte_range(
    read: Callable[[int, int], bytes], size: int, *, offset: int | None, tail: int | None, limit: int | None
) -> tuple[int, int]:
    """[start, end) of a log of `size` bytes: from `offset` (default 0), or the last `tail` lines at or after it;
    at most `limit` bytes."""
    start = min(offset or 0, size)
    if tail is not None:
        start = tail_offset(read, size, tail, floor=start)
    end = size if limit is None else min(size, start + limit)
    return start, end


def file_reader(handle: IO[bytes]) -> Callable[[int, int], bytes]:
    def read(pos: int, n: int) -> bytes:
        handle.seek(pos)
        return handle.read(n)

    return read


def bytes_reader(data: bytes) -> Callable[[int, int], bytes]:
    return lambda pos, n: data[pos : pos + n]


def file_chunks(handle: IO[bytes], start: int, end: int) -> Iterator[bytes]:
    """Bytes [start, end) of an open file, CHUNK at a time; closes the file when done (or abandoned)."""
    try:
        handle.seek(start)
        left = end - start
        while left > 0:
            chunk = handle.read(min(CHUNK, left))
            if not chunk:
                return
            left -= len(chunk)
            yield chunk
    finally:
        handle.close()


def open_stored(path: Path) -> tuple[IO[bytes], int] | None:
    """The stored copy opened for reading, with its size; None if there is none."""
    try:
        handle = open(path, "rb")  # noqa: SIM115 - handed to file_chunks, which closes it
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    return handle, handle.seek(0, 2)


@dataclass
class _Entry:
    lock: threading.Lock = field(default_factory=threading.Lock)
    fetched_at: float | None = None
    data: bytes | None = None


class RayLogs:
    """The whole Ray log of an attempt (Ray's Jobs API has no ranged read), fetched at most once per `max_age`
    seconds per submission in this process, however many requests and followers ask for it at once."""

    KEEP_SECONDS = 60.0  # an entry nobody asked for in this long is dropped

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}

    def get(self, ray: Any, submission_id: str, *, max_age: float) -> bytes | None:
        """The log's bytes, or None when Ray does not answer or does not know the submission."""
        now = time.monotonic()
        with self._lock:
            for key in [k for k, e in self._entries.items() if e.fetched_at and now - e.fetched_at > self.KEEP_SECONDS]:
                if not self._entries[key].lock.locked():
                    del self._entries[key]
            entry = self._entries.setdefault(submission_id, _Entry())
        with entry.lock:  # one fetch at a time per submission: the others wait for it and share it
            if entry.fetched_at is not None and time.monotonic() - entry.fetched_at < max_age:
                return entry.data
            try:
                text = ray.logs(submission_id)
            except InfraError:
                text = None
            entry.data = None if text is None else text.encode("utf-8", errors="replace")
            entry.fetched_at = time.monotonic()
            return entry.data


def stored_size(path: Path) -> int | None:
    """The stored copy's size, or None if there is none."""
    try:
        return path.stat().st_size if path.is_file() else None
    except OSError:
        return None


def read_at(path: Path, start: int, n: int) -> bytes:
    """`n` bytes of the file from `start` (fewer at its end)."""
    with open(path, "rb") as handle:
        handle.seek(start)
        return handle.read(n)


def stored_tail(path: Path, size: int, lines: int, floor: int) -> int:
    """Where the last `lines` lines of the stored copy (at or after `floor`) start."""
    with open(path, "rb") as handle:
        return tail_offset(file_reader(handle), size, lines, floor=min(floor, size))
