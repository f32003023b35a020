"""Reading attempt logs in bounded memory: byte ranges and tails of shunter's stored copy (read with seek, never
whole), and of a running attempt's Ray log (read by range from Ray, never whole: `service.backends.driver_logs`), whose
size and last block are looked at once per poll interval however many followers ask.

Offsets are bytes of the log. The stored copy of an ended attempt is a byte copy of Ray's file, so an offset taken
while the attempt ran still points at the same place once it has ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from service.core.errors import InfraError
from service.core.masking import Masker

log = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class RayLogView:
    """A running attempt's Ray log as last looked at: its size then, and its last block (the bytes
    [block_start, size), at most one block: all of the log this process keeps for the attempt)."""

    submission_id: str
    size: int
    block_start: int
    block: bytes


def _aligned(pos: int, block: int) -> int:
    return pos - pos % block


def _looked(ray: Any, submission_id: str, before: RayLogView | None, block: int) -> RayLogView | None:
    """The log's size and last block now, in one ranged read of Ray's log (two when it has grown past a block)."""
    base = _aligned(max(before.size - 1, 0), block) if before is not None else 0
    piece = ray.log_range(submission_id, base, block)
    if piece is not None and base + len(piece.data) != piece.size:  # its end lies in another block now
        base = _aligned(max(piece.size - 1, 0), block)
        piece = ray.log_range(submission_id, base, block)
    if piece is None:
        return None
    # A log that grew between the two reads is seen as far as the block read: the next look sees the rest.
    return RayLogView(submission_id, min(piece.size, base + len(piece.data)), base, piece.data)


@dataclass
class _Entry:
    lock: threading.Lock = field(default_factory=threading.Lock)
    fetched_at: float | None = None
    view: RayLogView | None = None
    error: InfraError | None = None  # Ray did not answer the last look


class RayLogs:
    """Running attempts' Ray logs, read by byte range (`Backend.log_range`), never whole: per submission, its size and
    last block, looked at once per `max_age` seconds in this process however many requests and followers ask, and
    kept for `KEEP_SECONDS` after the last ask (at most `MAX_ENTRIES` submissions: one block each)."""

    KEEP_SECONDS = 60.0
    MAX_ENTRIES = 64  # what all of them hold is at most this many blocks

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    def view(self, ray: Any, submission_id: str, *, max_age: float, block: int) -> RayLogView | None:
        """The log's size and last block, or None when Ray does not know the submission (not submitted yet: an
        attempt's row is written before its submission). `InfraError` when Ray does not answer: that answer is kept
        for `max_age` too, so a Ray that is away is not asked by every request."""
        now = time.monotonic()
        with self._lock:
            for key in [k for k, e in self._entries.items() if e.fetched_at and now - e.fetched_at > self.KEEP_SECONDS]:
                if not self._entries[key].lock.locked():
                    del self._entries[key]
            entry = self._entries.setdefault(submission_id, _Entry())
            self._entries.move_to_end(submission_id)
            while len(self._entries) > self.MAX_ENTRIES:
                self._entries.popitem(last=False)  # an entry being refreshed now is simply not kept for others
        with entry.lock:  # one look at a time per submission: the others wait for it and share it
            if entry.fetched_at is None or time.monotonic() - entry.fetched_at >= max_age:
                before = entry.view if entry.view is not None and len(entry.view.block) <= block else None
                try:
                    entry.view, entry.error = _looked(ray, submission_id, before, block), None
                except InfraError as exc:
                    log.debug("Ray did not answer for the log of %s", submission_id, exc_info=True)
                    entry.view, entry.error = None, exc
                entry.fetched_at = time.monotonic()
            if entry.error is not None:
                raise entry.error
            return entry.view


class RayLogReader:
    """One request's reads of a running attempt's Ray log, as of `view`: by aligned block, the two last read kept
    (a tail's backward scan reads each block once), so a request holds at most two blocks besides the shared one."""

    KEPT = 2

    def __init__(self, ray: Any, view: RayLogView, block: int) -> None:
        self.ray, self.view, self.block = ray, view, block
        self._kept: OrderedDict[int, bytes] = OrderedDict()

    def read(self, pos: int, n: int) -> bytes:
        """Bytes [pos, pos + n) of the log as of the view (fewer at its end)."""
        out = bytearray()
        end = min(pos + n, self.view.size)
        while pos < end:
            base = _aligned(pos, self.block)
            piece = self._block(base)[pos - base : end - base]
            if not piece:
                break  # Ray has less than it said: what there is
            out += piece
            pos += len(piece)
        return bytes(out)

    def _block(self, base: int) -> bytes:
        if base == self.view.block_start:
            return self.view.block
        if (kept := self._kept.get(base)) is not None:
            return kept
        piece = self.ray.log_range(self.view.submission_id, base, min(self.block, self.view.size - base))
        if piece is None:
            raise InfraError(f"Ray no longer knows {self.view.submission_id}: its log cannot be read on")
        self._kept[base] = piece.data
        while len(self._kept) > self.KEPT:
            self._kept.popitem(last=False)
        return piece.data

    def chunks(self, start: int, end: int) -> Iterator[bytes]:
        """Bytes [start, end): from the shared last block when it holds them, else streamed from Ray by range."""
        if start >= end:
            return iter(())
        if start >= self.view.block_start:
            return iter([self.view.block[start - self.view.block_start : end - self.view.block_start]])
        stream = self.ray.log_stream(self.view.submission_id, start, end)
        if stream is None:
            raise InfraError(f"Ray no longer knows {self.view.submission_id}: its log cannot be read on")
        return stream


def started(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """`chunks` with its first read already done: a Ray that fails then is the request's 503, before any answer."""
    try:
        first = next(chunks, b"")
    except BaseException:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
        raise

    def rest() -> Iterator[bytes]:
        try:
            if first:
                yield first
            yield from chunks
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()  # an abandoned answer lets go of its read from Ray at once

    return rest()


async def ray_chunks(
    reader: RayLogReader | MaskedReader, start: int, end: int, deadline: float
) -> AsyncIterator[bytes]:
    """Bytes [start, end) of a running attempt's Ray log for a follow stream, a chunk at a time (each read in a
    thread), until `deadline`."""
    chunks = await asyncio.to_thread(reader.chunks, start, end)
    try:
        while time.monotonic() < deadline:
            chunk = await asyncio.to_thread(next, chunks, None)
            if chunk is None:
                return
            if chunk:
                yield chunk
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            # A stream cancelled while a read runs in its thread: that read ends by itself, and the rest with it.
            with contextlib.suppress(ValueError):
                close()


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


class MaskedReader:
    """A Ray log reader whose answers have the job's secret values starred out (`service.core.masking`): each read
    or stream reaches `masker.reach` bytes past its ends, so a value cut by a range's edge is still found; every byte
    stays where it was, and offsets read the same as unmasked."""

    def __init__(self, reader: RayLogReader, masker: Masker) -> None:
        self.reader, self.masker = reader, masker

    def read(self, pos: int, n: int) -> bytes:
        return self.masker.read(self.reader.read, pos, n)

    def chunks(self, start: int, end: int) -> Iterator[bytes]:
        if not self.masker or start >= end:
            return self.reader.chunks(start, end)
        wide_start = max(0, start - self.masker.reach)
        inner = self.reader.chunks(wide_start, min(end + self.masker.reach, self.reader.view.size))
        return _cut(self.masker.stream(inner), skip=start - wide_start, take=end - start, inner=inner)


def _cut(chunks: Iterator[bytes], *, skip: int, take: int, inner: Iterator[bytes]) -> Iterator[bytes]:
    try:
        for chunk in chunks:
            if skip:
                chunk, skip = chunk[skip:], max(0, skip - len(chunk))
            chunk = chunk[:take]
            if chunk:
                yield chunk
                take -= len(chunk)
            if not take:
                return
    finally:
        close = getattr(inner, "close", None)
        if close is not None:
            close()
