"""Growing a running elastic job toward its `max` as room appears (issue 16). Pure; table-driven tests cover it.

A resize restarts the worker group from a checkpoint whichever way it is done (Ray Train's own elastic resize also
tears the group down and starts it again at the new size), so shunter grows a job the same way it yields one: it asks
the job to checkpoint (the preemption notice), stops the attempt, and admits it again at once, at the most workers
that fit then. What caps the growth:

- **Waiting jobs first.** No job grows while a job of equal or higher priority waits (in any queue): the free room
  is theirs to take. Jobs of lower priority do not hold a higher-priority job back from its `max`.
- **Limits and quotas.** The larger size must stay within the queue's limits and the owner's and team's quotas,
  counted on top of what the job holds now.
- **Settling time.** An attempt grows at most once it has run `after_seconds` (`SHUNTER_ELASTIC_GROW_AFTER_SECONDS`),
  so each restart is paid for by a stretch of training at the new size, and room that flickers free does not turn
  into a restart per tick.
- **Worth a restart.** The job must gain at least `min_gain` of its current workers (at least one worker).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from service.core import resources
from service.policy.scheduler import Candidate, NodeFree, sized


@dataclass(frozen=True)
class Growable:
    """A running elastic job as growth sees it: its candidate (range and per-worker resources) and its size now."""

    candidate: Candidate  # num_workers: the range's max; min_workers: its min
    size: int  # workers of the running attempt
    running_seconds: float  # since the attempt was admitted


def grow(
    jobs: list[Growable],
    nodes: list[NodeFree],
    *,
    waiting: list[int],
    after_seconds: float,
    min_gain: float = 0.0,
    check: Callable[[Candidate, dict[str, float]], str | None] = lambda cand, total: None,
) -> dict[str, int]:
    """Which running elastic jobs to restart larger, and at what size: job id -> workers.

    `nodes`: the room left free after this pass's admissions; `waiting`: the priorities of the jobs still waiting;
    `check(cand, extra)`: the quota or limit that `extra` resources on top of what the job holds would break (None:
    within all). Higher priority grows first, and each growth takes its room from `nodes` before the next is sized.
    """
    top_waiting = max(waiting, default=None)
    left = [NodeFree(n.node_id, dict(n.free)) for n in nodes]
    out: dict[str, int] = {}
    for job in sorted(jobs, key=lambda j: (-j.candidate.priority, j.candidate.seq)):
        cand = job.candidate
        room = cand.num_workers - job.size
        if room <= 0 or job.running_seconds < after_seconds:
            continue
        if top_waiting is not None and top_waiting >= cand.priority:
            continue
        need = max(1, math.ceil(job.size * min_gain))
        if need > room:
            continue
        extra = replace(cand, num_workers=room, min_workers=need)
        fitted, placed, _ = sized(extra, left, functools.partial(_checked_for, check, cand))
        if placed is None:
            continue
        by_id = {n.node_id: n for n in left}
        for node_id in placed:
            resources.take(by_id[node_id].free, cand.per_worker)
        out[cand.job_id] = job.size + fitted.num_workers
    return out


def _checked_for(
    check: Callable[[Candidate, dict[str, float]], str | None], cand: Candidate, total: dict[str, float]
) -> str | None:
    """`check` of one candidate, as `sized` asks it: by the group's total alone."""
    return check(cand, total)
