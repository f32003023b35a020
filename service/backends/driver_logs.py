"""A Ray Job's driver log read by byte range, never whole (issue 35, item 11).

Ray's Jobs API has no ranged read: `GET /api/jobs/<id>/logs` (what `JobSubmissionClient.get_job_logs` calls) answers
the whole file as one JSON string, and the head's state API (`/api/v0/logs/file`, `ray.util.state.get_log`) takes a
number of last lines, not byte offsets. The file itself, `job-driver-<submission id>.log`, lies in the session's log
directory of the driver's node, and that node's dashboard agent serves the directory over HTTP (`/logs/`, aiohttp's
static route, which answers `Range` requests with 206). Ray tells where in the job's own record:
`driver_agent_http_address` (what the head itself calls to proxy the Jobs API's log reads).

So a read asks the agent for exactly the bytes it wants, with the cluster's token: this works wherever the API or a
dispatcher runs, on the head or off it, as long as it reaches the nodes' agent port (52365 by default), which the head
needs too. Where it cannot (the agent's port closed to this host), or the agent has no such file yet, the fallback is
the head's state API, which streams the file from its first byte: bounded memory still, but a pass over the log up to
the range (and to its end when its size is wanted). An agent found unreachable is not tried again for
`AGENT_RETRY_SECONDS`.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from urllib.parse import quote

import httpx

from service.core.backend import LogPiece
from service.core.errors import InfraError

log = logging.getLogger(__name__)
JOB_LOG_NAME = "job-driver-{submission_id}.log"  # ray.dashboard.modules.job.common.JOB_LOGS_PATH_TEMPLATE
CHUNK = 64 * 1024
AGENT_CONNECT_SECONDS = 3.0
AGENT_RETRY_SECONDS = 60.0
PLACES_KEPT = 4096  # submission ids whose driver's agent is remembered (a driver never moves: one Ray Job per attempt)
_TOTAL = re.compile(r"bytes (?:\d+-\d+|\*)/(\d+)")


class _Unreachable(Exception):
    """The agent did not take the connection."""


class _NotThere(Exception):
    """The agent has no such file (not written yet, or an agent without the log route)."""


class DriverLogs:
    """Ranged reads of Ray Jobs' driver logs: from the driver's agent, or the head's state API out of its reach."""

    def __init__(self, dashboard: httpx.Client, *, headers: dict[str, str], timeout: float) -> None:
        self._dashboard = dashboard
        self._agent = httpx.Client(
            timeout=httpx.Timeout(timeout, connect=AGENT_CONNECT_SECONDS),
            headers={**headers, "Accept-Encoding": "identity"},  # byte offsets are of the file, not of a gzip of it
        )
        self._lock = threading.Lock()
        self._places: OrderedDict[str, tuple[str, str | None]] = OrderedDict()
        self._down_until: dict[str, float] = {}

    def close(self) -> None:
        self._agent.close()

    def read(self, submission_id: str, start: int, length: int) -> LogPiece | None:
        """At most `length` bytes from `start`, and the log's size now; None if Ray has no such job."""
        if length < 1 or start < 0:
            raise ValueError(f"a log range needs start >= 0 and length >= 1, not {start}, {length}")
        place = self._place(submission_id)
        if place is None:
            return None
        with self._opened(submission_id, place, start, start + length) as (at, size, chunks):
            data, seen = _take(chunks, at=at, start=start, end=start + length, drain=size is None)
        return LogPiece(start, data, seen if size is None else size)

    def stream(self, submission_id: str, start: int, end: int | None) -> Iterator[bytes] | None:
        """Bytes [start, end) (to the log's end now, for None), a chunk at a time; None if Ray has no such job."""
        place = self._place(submission_id)
        if place is None:
            return None
        return self._chunks(submission_id, place, start, end)

    def _chunks(self, submission_id: str, place: tuple[str | None, str | None], start: int,
                end: int | None) -> Iterator[bytes]:  # fmt: skip
        if end is not None and end <= start:
            return
        with self._opened(submission_id, place, start, end) as (at, _, chunks):
            pos = at
            for chunk in chunks:
                lo, hi = max(start - pos, 0), len(chunk) if end is None else min(end - pos, len(chunk))
                if lo < hi:
                    yield chunk[lo:hi]
                pos += len(chunk)
                if end is not None and pos >= end:
                    return

    # ---- where the log is --------------------------------------------------------------------------------------
    def _place(self, submission_id: str) -> tuple[str | None, str | None] | None:
        """(the driver's agent URL, its node id) from Ray's record of the job (None, None before its driver started);
        None if Ray has no such job."""
        with self._lock:
            if (known := self._places.get(submission_id)) is not None:
                self._places.move_to_end(submission_id)
                return known
        try:
            r = self._dashboard.get(f"/api/jobs/{quote(submission_id)}")
        except httpx.HTTPError as exc:
            raise InfraError(f"Ray dashboard unreachable: {exc}") from exc
        if r.status_code == 404:
            return None
        if r.status_code != 200:
            raise InfraError(f"Ray Jobs API answered {r.status_code} for {submission_id}")
        body = r.json()
        agent, node = body.get("driver_agent_http_address") or None, body.get("driver_node_id") or None
        if agent is not None:
            with self._lock:
                self._places[submission_id] = (str(agent).rstrip("/"), node)
                while len(self._places) > PLACES_KEPT:
                    self._places.popitem(last=False)
        return (None if agent is None else str(agent).rstrip("/")), node

    # ---- reading -----------------------------------------------------------------------------------------------
    @contextmanager
    def _opened(self, submission_id: str, place: tuple[str | None, str | None], start: int,
                end: int | None) -> Iterator[tuple[int, int | None, Iterator[bytes]]]:  # fmt: skip
        """(the log's byte the chunks start at, the log's size if known now, the chunks), from the agent or the head."""
        agent, node = place
        if agent is None:  # the driver has not started: nothing written yet
            yield start, 0, iter(())
            return
        with ExitStack() as stack:
            opened = None
            if time.monotonic() >= self._down_until.get(agent, 0.0):
                try:
                    opened = stack.enter_context(self._from_agent(agent, submission_id, start, end))
                except _Unreachable as exc:
                    self._down_until[agent] = time.monotonic() + AGENT_RETRY_SECONDS
                    log.warning("Ray's agent at %s cannot be reached from here (%s): driver logs are read through "
                                "the head's state API, from their start, for %.0fs", agent, exc,
                                AGENT_RETRY_SECONDS)  # fmt: skip
                except _NotThere:
                    pass
            if opened is None:
                opened = stack.enter_context(self._from_head(submission_id, node))
            yield opened

    @contextmanager
    def _from_agent(self, agent: str, submission_id: str, start: int,
                    end: int | None) -> Iterator[tuple[int, int | None, Iterator[bytes]]]:  # fmt: skip
        url = f"{agent}/logs/{quote(JOB_LOG_NAME.format(submission_id=submission_id))}"
        wanted = f"bytes={start}-" if end is None else f"bytes={start}-{end - 1}"
        try:
            with self._agent.stream("GET", url, headers={"Range": wanted}) as r:
                if r.status_code == 404:
                    raise _NotThere(url)
                if r.status_code == 416:  # from past the end: nothing, and the size
                    yield start, _total(r, agent), iter(())
                elif r.status_code == 206:
                    yield start, _total(r, agent), _guarded(r.iter_bytes(CHUNK))
                elif r.status_code == 200:  # the range not honoured: the whole file, from byte 0
                    length = r.headers.get("content-length")
                    yield 0, int(length) if length and length.isdigit() else None, _guarded(r.iter_bytes(CHUNK))
                else:
                    raise InfraError(f"Ray's agent at {agent} answered {r.status_code} for the log of {submission_id}")
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise _Unreachable(str(exc) or type(exc).__name__) from exc
        except httpx.HTTPError as exc:
            raise InfraError(f"Ray's agent at {agent}: {exc}") from exc

    @contextmanager
    def _from_head(self, submission_id: str, node: str | None) -> Iterator[tuple[int, int | None, Iterator[bytes]]]:
        name = JOB_LOG_NAME.format(submission_id=submission_id)
        where: dict[str, Any] = {"node_id": node, "filename": name} if node else {"submission_id": submission_id}
        try:
            with self._dashboard.stream("GET", "/api/v0/logs/file", params={**where, "lines": -1}) as r:
                if r.status_code != 200:
                    r.read()
                    raise InfraError(f"Ray's state API answered {r.status_code} for the log of {submission_id}: "
                                     f"{r.text[:300]}")  # fmt: skip
                yield 0, None, _guarded(r.iter_bytes(CHUNK))
        except httpx.HTTPError as exc:
            raise InfraError(f"Ray's state API: {exc}") from exc


def _total(r: httpx.Response, agent: str) -> int:
    """The file's size, from a ranged answer's `Content-Range`."""
    found = _TOTAL.fullmatch(r.headers.get("content-range", "").strip())
    if found is None:
        raise InfraError(f"Ray's agent at {agent} answered a range without its Content-Range")
    return int(found.group(1))


def _guarded(chunks: Iterator[bytes]) -> Iterator[bytes]:
    try:
        yield from chunks
    except httpx.HTTPError as exc:
        raise InfraError(f"Ray's log read broke off: {exc}") from exc


def _take(chunks: Iterator[bytes], *, at: int, start: int, end: int, drain: bool) -> tuple[bytes, int]:
    """Bytes [start, end) of chunks that begin at byte `at`, and how far the chunks went (the log's size, if `drain`:
    read to their end, keeping nothing more)."""
    out = bytearray()
    pos = at
    for chunk in chunks:
        lo, hi = max(start - pos, 0), min(end - pos, len(chunk))
        if lo < hi:
            out += chunk[lo:hi]
        pos += len(chunk)
        if pos >= end and not drain:
            break
    return bytes(out), pos
