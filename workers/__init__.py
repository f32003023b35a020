"""shunter's job side; `report` is the one helper a user's script may call itself.

    from workers import report
    report(step=12, loss=0.5, lr=1e-4)

It sends the metrics to shunter as the job's progress, from rank 0 only (`RANK` unset or "0"); outside shunter (no
`SHUNTER_PROGRESS_URL`) and on other ranks it does nothing and returns False. It never raises: a point the API could
not take is logged and dropped, as losing one progress point must never fail a training run.

This package is imported by the control plane too, which must stay free of torch: nothing heavy is imported here, and
`report` imports what it needs when first called.
"""

from __future__ import annotations

import functools
import itertools
import logging
import operator
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.attempt_api import AttemptApi

__all__ = ["report"]

log = logging.getLogger(__name__)
_steps = itertools.count(1)  # the step of a report that names none


@functools.lru_cache(maxsize=1)
def _api(url: str, token: str, job_id: str, attempt: str) -> AttemptApi | None:
    """This process's AttemptApi, made once (per environment: the cache key is what it is made from)."""
    from workers.context import attempt_api

    return attempt_api()


def _whole(step: object) -> int | None:
    """`step` as an int >= 0 (numpy and torch integers too), else None (logged)."""
    try:
        if not isinstance(step, bool):
            value = operator.index(step)  # type: ignore[arg-type]  # any object: a TypeError is the answer
            if value >= 0:
                return value
    except TypeError:
        pass
    log.warning("shunter: report(step=%r) ignored: step must be an int >= 0", step)
    return None


def report(step: int | None = None, **metrics: float) -> bool:
    """Send `metrics` (finite numbers; others are left out) at `step` (1, 2, ... counted here when None) to shunter.

    True when the API recorded it; False outside shunter, on a rank other than 0, when the attempt is no longer
    current, or when it failed (logged).
    """
    try:
        if os.environ.get("RANK", "0") not in ("", "0") or not os.environ.get("SHUNTER_PROGRESS_URL"):
            return False
        api = _api(*(os.environ.get(name, "") for name in ("SHUNTER_PROGRESS_URL", "SHUNTER_ATTEMPT_TOKEN",
                                                           "SHUNTER_JOB_ID", "SHUNTER_ATTEMPT")))  # fmt: skip
        if api is None:
            return False
        if step is None:
            step = next(_steps)
        else:
            step = _whole(step)
            if step is None:
                return False
        return api.report(metrics, step=step, patience=0.0)
    except Exception as exc:  # noqa: BLE001 - see module docstring
        log.warning("shunter: a progress report was dropped: %s", exc)
        return False
