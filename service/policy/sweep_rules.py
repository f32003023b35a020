"""The two decisions of sweeps, pure: which queued members `max_parallel` holds back, and how members rank."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

ENDED_BADLY = frozenset({"FAILED", "CANCELLED"})


@dataclass(frozen=True)
class Queued:
    """A queued member of a sweep that has a max_parallel."""

    job_id: str
    sweep_id: str
    index: int


def hold(queued: Sequence[Queued], active: Mapping[str, int], max_parallel: Mapping[str, int]) -> dict[str, str]:
    """job id -> why it waits, for each queued member that may not be admitted in this pass: a sweep with `active`
    members admitted (starting, running or cancelling) offers its lowest-indexed queued members the
    `max_parallel - active` places left, and holds the rest. Members of sweeps without a limit are never held."""
    held: dict[str, str] = {}
    by_sweep: dict[str, list[Queued]] = {}
    for member in queued:
        if member.sweep_id in max_parallel:
            by_sweep.setdefault(member.sweep_id, []).append(member)
    for sweep_id, members in by_sweep.items():
        limit, running = max_parallel[sweep_id], active.get(sweep_id, 0)
        free = max(0, limit - running)
        why = f"sweep {sweep_id} has {running} of max_parallel {limit} members running"
        if free:
            why += "; the free places go to members of lower index first"
        for member in sorted(members, key=lambda m: (m.index, m.job_id))[free:]:
            held[member.job_id] = why
    return held


@dataclass(frozen=True)
class Scored:
    """A member as ranking sees it: its state and the last value it reported of the sweep's metric (None: none)."""

    index: int
    state: str
    value: float | None


def rank(members: Sequence[Scored], mode: str) -> list[int]:
    """Indexes of the members that reported the metric, best first: members that did not fail or get cancelled
    ahead of those that did, then by value (lowest first for mode min, highest for max), ties by index."""
    sign = 1.0 if mode == "min" else -1.0
    scored = [m for m in members if m.value is not None and math.isfinite(m.value)]
    ordered = sorted(scored, key=lambda m: (m.state in ENDED_BADLY, sign * float(m.value or 0.0), m.index))
    return [m.index for m in ordered]


def best(members: Sequence[Scored], mode: str) -> int | None:
    """The index of the best member (the first ranked), unless every member that reported failed or was cancelled:
    while members still run, the leader so far."""
    by_index = {m.index: m for m in members}
    ranked = rank(members, mode)
    if not ranked or by_index[ranked[0]].state in ENDED_BADLY:
        return None
    return ranked[0]
