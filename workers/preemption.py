"""Preemption notices: the dispatcher drops a marker beside the job's checkpoints; shunter's report helper sees it,
checkpoints at once on every rank and waits there (`hold`), and the dispatcher then stops the attempt and requeues the
job, which resumes from that checkpoint with no step lost. (The same notice asks an elastic job to yield so that it
can be admitted again larger: service/policy/growth.py.)

The check is agreed across ranks (an all-reduce of each rank's view) so that every rank takes the collective
checkpoint at the same step, and it reads storage at most every CHECK_SECONDS.
"""

from __future__ import annotations

import json
import os
import time

from service.core.locations import preemption_marker
from workers.context import ENV_STORAGE, attempt, job_id

CHECK_SECONDS = 2.0
HOLD_SECONDS = 600.0  # the longest a checkpointed loop waits to be stopped before it trains on (a lost stop)
_last_check = 0.0
_seen = False
_answered = False  # one checkpoint per notice: after the collective "yes", stop asking


def marker_path() -> tuple[str, object] | None:
    """(path, pyarrow filesystem or None) of this job's marker, or None outside a shunter job."""
    storage, job = os.environ.get(ENV_STORAGE), job_id()
    if not storage or not job:
        return None
    return preemption_marker(storage, job)


def _marker_exists() -> bool:
    """Whether the marker is there and asks this attempt (one naming another attempt was left behind)."""
    where = marker_path()
    if where is None:
        return False
    path, fs = where
    try:
        if fs is None:
            with open(path, "rb") as marker:
                body = marker.read(4096)
        else:
            with fs.open_input_stream(path) as marker:  # type: ignore[attr-defined]  # a pyarrow FileSystem, typed loosely here
                body = marker.read(4096)
    except FileNotFoundError:
        return False
    return for_this_attempt(body)


def for_this_attempt(body: bytes) -> bool:
    try:
        asked = json.loads(body).get("attempt")
    except (ValueError, AttributeError):  # an older service's marker (a timestamp): it asks whoever sees it
        return True
    return not isinstance(asked, int) or asked == attempt()


def requested() -> bool:
    """Whether this job has been asked to yield; the same answer on every rank (collective when distributed)."""
    global _last_check, _seen, _answered
    if _answered:
        return False
    now = time.monotonic()
    if not _seen and now - _last_check >= CHECK_SECONDS:
        _last_check = now
        try:
            _seen = _marker_exists()
        except OSError:
            _seen = False
    from workers.ranks import any_rank

    _answered = any_rank(_seen)
    return _answered


def hold(seconds: float = HOLD_SECONDS) -> None:
    """Wait, on every rank, for the dispatcher to stop the attempt: it does once the checkpoint just reported is in
    (or its grace has run out). Should the stop not come in `seconds`, train on rather than hang."""
    time.sleep(seconds)
