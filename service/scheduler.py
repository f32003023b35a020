"""Admission policy: which queued jobs start now. Pure: no I/O, no clock; table-driven tests cover it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Candidate:
    """A queued job as the policy sees it: its worker group and its place in the order."""

    job_id: str
    priority: int
    seq: float  # FIFO key within a priority (creation time)
    num_workers: int
    per_worker: dict[str, float]
    placement: str = "pack"  # pack | spread | strict_pack | strict_spread


@dataclass
class NodeFree:
    node_id: str
    free: dict[str, float] = field(default_factory=dict)


def _fits_one(free: dict[str, float], need: dict[str, float]) -> bool:
    return all(free.get(k, 0.0) + 1e-9 >= v for k, v in need.items())


def _take(free: dict[str, float], need: dict[str, float]) -> None:
    for k, v in need.items():
        free[k] = free.get(k, 0.0) - v


def place(candidate: Candidate, nodes: list[NodeFree]) -> list[str] | None:
    """Node ids for each worker, or None if the whole group cannot be placed now. Never a partial group.

    pack fills the fullest-fitting nodes first; spread puts each worker on the node with most room;
    strict_pack needs one node for all; strict_spread needs a distinct node per worker.
    """
    free = {n.node_id: dict(n.free) for n in nodes}
    need = candidate.per_worker
    chosen: list[str] = []
    if candidate.placement == "strict_pack":
        total = {k: v * candidate.num_workers for k, v in need.items()}
        for node_id, room in free.items():
            if _fits_one(room, total):
                return [node_id] * candidate.num_workers
        return None
    for _ in range(candidate.num_workers):
        fitting = [nid for nid, room in free.items() if _fits_one(room, need)]
        if candidate.placement == "strict_spread":
            fitting = [nid for nid in fitting if nid not in chosen]
        if not fitting:
            return None
        key = sum  # room left, summed over the asked resources
        if candidate.placement in ("spread", "strict_spread"):
            node_id = max(fitting, key=lambda nid: (-chosen.count(nid), key(free[nid].get(k, 0) for k in need)))
        else:
            node_id = min(fitting, key=lambda nid: (-chosen.count(nid), key(free[nid].get(k, 0) for k in need)))
        _take(free[node_id], need)
        chosen.append(node_id)
    return chosen


def order(candidates: list[Candidate]) -> list[Candidate]:
    """Higher priority first, FIFO within a priority."""
    return sorted(candidates, key=lambda c: (-c.priority, c.seq, c.job_id))


def pick(candidates: list[Candidate], nodes: list[NodeFree], *, backfill: bool = True) -> list[str]:
    """The job ids to admit now, in order, each with room for its whole worker group.

    Without backfill the first job that does not fit blocks the rest (strict order). With backfill, later jobs may
    start in the room left while an earlier one waits for more.
    """
    free_nodes = [NodeFree(n.node_id, dict(n.free)) for n in nodes]
    admitted: list[str] = []
    for cand in order(candidates):
        placed = place(cand, free_nodes)
        if placed is None:
            if not backfill:
                break
            continue
        by_id = {n.node_id: n for n in free_nodes}
        for node_id in placed:
            _take(by_id[node_id].free, cand.per_worker)
        admitted.append(cand.job_id)
    return admitted
