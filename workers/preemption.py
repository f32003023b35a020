"""Preemption notices: the dispatcher drops a marker beside the job's checkpoints; shunter's report helper sees it,
checkpoints at once on every rank, and the dispatcher then stops the attempt and requeues the job.

The check is agreed across ranks (an all-reduce of each rank's view) so that every rank takes the collective
checkpoint at the same step, and it reads storage at most every CHECK_SECONDS.
"""

from __future__ import annotations

import os
import time

from service.storage import preemption_marker
from workers.context import ENV_STORAGE, job_id

CHECK_SECONDS = 2.0
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
    where = marker_path()
    if where is None:
        return False
    path, fs = where
    if fs is None:
        return os.path.exists(path)
    from pyarrow import fs as pafs

    return fs.get_file_info(path).type != pafs.FileType.NotFound  # type: ignore[attr-defined]


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
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([1 if _seen else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        _answered = bool(flag.item())
        return _answered
    _answered = _seen
    return _seen
