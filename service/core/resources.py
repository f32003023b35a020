"""Resource arithmetic, in one place: a worker's needs, a job's total, the free room of nodes.

Amounts are Ray's: `CPU`, `GPU`, `memory` (bytes) and custom resources, as `{name: float}`. Ray's per-node
`node:<ip>` markers are not resources a job asks for and are left out of sums. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

EPSILON = 1e-9  # Ray's fractional resources: 0.1 * 3 must fit in 0.3


def scaled(per_worker: Mapping[str, float], workers: int) -> dict[str, float]:
    """What `workers` workers of `per_worker` hold together."""
    return {k: v * workers for k, v in per_worker.items()}


def sum_of(amounts: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """The sum of several resource maps (node markers left out)."""
    out: dict[str, float] = {}
    for amount in amounts:
        for key, value in amount.items():
            if not key.startswith("node:"):
                out[key] = out.get(key, 0.0) + float(value)
    return out


def fits(free: Mapping[str, float], need: Mapping[str, float]) -> bool:
    """Whether `need` fits in `free`, resource by resource."""
    return all(free.get(k, 0.0) + EPSILON >= v for k, v in need.items())


def take(free: dict[str, float], need: Mapping[str, float]) -> None:
    """Take `need` off `free` in place (it may go negative: the caller checked `fits` when it mattered)."""
    for key, value in need.items():
        free[key] = free.get(key, 0.0) - value


def give(free: dict[str, float], amount: Mapping[str, float]) -> None:
    """Give `amount` back to `free` in place (what a stopped job frees)."""
    for key, value in amount.items():
        free[key] = free.get(key, 0.0) + value


def take_spread(frees: list[dict[str, float]], need: Mapping[str, float]) -> None:
    """Take `need` off several nodes' room, roomiest first: for work admitted but not yet placed, where Ray will put
    it is unknown."""
    for key, amount in need.items():
        remaining = amount
        for free in sorted(frees, key=lambda f: -f.get(key, 0.0)):
            share = min(remaining, max(free.get(key, 0.0), 0.0))
            free[key] = free.get(key, 0.0) - share
            remaining -= share
            if remaining <= 0:
                break


def workers_fitting(total: Mapping[str, float], per_worker: Mapping[str, float]) -> int:
    """How many workers of `per_worker` one node of `total` could ever hold."""
    counts = [int(total.get(k, 0.0) // v) for k, v in per_worker.items() if v > 0]
    return min(counts) if counts else 0


ACCELERATOR_PREFIX = "accelerator_type:"  # Ray's resource of a node's accelerator type (`accelerator_type:A100`)


def accelerator_of(per_worker: Mapping[str, float]) -> str | None:
    """The accelerator type a worker asks for (the spec's `accelerator_type`, or the raw resource key), or None."""
    return next((k[len(ACCELERATOR_PREFIX) :] for k in sorted(per_worker) if k.startswith(ACCELERATOR_PREFIX)), None)
