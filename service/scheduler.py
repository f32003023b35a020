"""Admission policy: which queued jobs start now. Pure: no I/O, no clock; table-driven tests cover it."""

from __future__ import annotations

from dataclasses import dataclass, field

from service import resources

WAITING_FOR_ROOM = "waiting for room"  # the start of the reason preemption looks for


@dataclass(frozen=True)
class Candidate:
    """A queued job as the policy sees it: its worker group and its place in the order."""

    job_id: str
    priority: int
    seq: float  # FIFO key within a priority (creation time, seconds)
    num_workers: int
    per_worker: dict[str, float]
    placement: str = "pack"  # pack | spread | strict_pack | strict_spread
    queue: str = "default"

    def total(self) -> dict[str, float]:
        return resources.scaled(self.per_worker, self.num_workers)


@dataclass(frozen=True)
class QueueLimit:
    """Caps on what one named queue may run at once (None: no cap)."""

    max_running: int | None = None
    max_cpus: float | None = None
    max_gpus: float | None = None
    preemption: bool = False  # may its jobs preempt lower-priority running jobs?


@dataclass
class QueueUsage:
    running: int = 0
    cpus: float = 0.0
    gpus: float = 0.0

    def add(self, total: dict[str, float]) -> None:
        self.running += 1
        self.cpus += total.get("CPU", 0.0)
        self.gpus += total.get("GPU", 0.0)


@dataclass
class Plan:
    admit: list[str] = field(default_factory=list)
    waiting: dict[str, str] = field(default_factory=dict)  # job id -> why it waits, for `state_reason`


@dataclass
class NodeFree:
    node_id: str
    free: dict[str, float] = field(default_factory=dict)


def place(candidate: Candidate, nodes: list[NodeFree]) -> list[str] | None:
    """Node ids for each worker, or None if the whole group cannot be placed now. Never a partial group.

    pack fills the fullest-fitting nodes first; spread puts each worker on the node with most room;
    strict_pack needs one node for all; strict_spread needs a distinct node per worker.
    """
    free = {n.node_id: dict(n.free) for n in nodes}
    need = candidate.per_worker
    chosen: list[str] = []
    if candidate.placement == "strict_pack":
        total = resources.scaled(need, candidate.num_workers)
        for node_id, room in free.items():
            if resources.fits(room, total):
                return [node_id] * candidate.num_workers
        return None
    for _ in range(candidate.num_workers):
        fitting = [nid for nid, room in free.items() if resources.fits(room, need)]
        if candidate.placement == "strict_spread":
            fitting = [nid for nid in fitting if nid not in chosen]
        if not fitting:
            return None
        key = sum  # room left, summed over the asked resources
        if candidate.placement in ("spread", "strict_spread"):
            node_id = max(fitting, key=lambda nid: (-chosen.count(nid), key(free[nid].get(k, 0) for k in need)))
        else:
            node_id = min(fitting, key=lambda nid: (-chosen.count(nid), key(free[nid].get(k, 0) for k in need)))
        resources.take(free[node_id], need)
        chosen.append(node_id)
    return chosen


def order(candidates: list[Candidate]) -> list[Candidate]:
    """Higher priority first, FIFO within a priority."""
    return sorted(candidates, key=lambda c: (-c.priority, c.seq, c.job_id))


def over_limit(cand: Candidate, limit: QueueLimit | None, usage: QueueUsage) -> str | None:
    """Why `cand` would break its queue's limits, or None."""
    if limit is None:
        return None
    total = cand.total()
    if limit.max_running is not None and usage.running + 1 > limit.max_running:
        return f"queue '{cand.queue}' is at its limit of {limit.max_running} running jobs"
    if limit.max_cpus is not None and usage.cpus + total.get("CPU", 0.0) > limit.max_cpus + 1e-9:
        return f"queue '{cand.queue}' would exceed its {limit.max_cpus:g} CPUs ({usage.cpus:g} in use)"
    if limit.max_gpus is not None and usage.gpus + total.get("GPU", 0.0) > limit.max_gpus + 1e-9:
        return f"queue '{cand.queue}' would exceed its {limit.max_gpus:g} GPUs ({usage.gpus:g} in use)"
    return None


def plan(
    candidates: list[Candidate],
    nodes: list[NodeFree],
    *,
    limits: dict[str, QueueLimit] | None = None,
    usage: dict[str, QueueUsage] | None = None,
    now: float = 0.0,
    reserve_after_seconds: float | None = None,
    backfill: bool = True,
) -> Plan:
    """The job ids to admit now, in order, each with room for its whole worker group; and why the rest wait.

    Higher priority first, FIFO within a priority. With backfill a later job may start in room an earlier one cannot
    use yet, until that earlier one has waited `reserve_after_seconds`: from then on nothing behind it starts, so the
    room it needs is kept for it as running jobs end (bounded wait instead of starvation).
    """
    limits = limits or {}
    usage = {k: QueueUsage(v.running, v.cpus, v.gpus) for k, v in (usage or {}).items()}
    free_nodes = [NodeFree(n.node_id, dict(n.free)) for n in nodes]
    result = Plan()
    holder: Candidate | None = None
    for cand in order(candidates):
        if holder is not None:
            result.waiting[cand.job_id] = f"held behind {holder.job_id}, which has waited longest for room"
            continue
        q_usage = usage.setdefault(cand.queue, QueueUsage())
        reason = over_limit(cand, limits.get(cand.queue), q_usage)
        if reason:
            result.waiting[cand.job_id] = reason
            continue
        placed = place(cand, free_nodes)
        if placed is None:
            result.waiting[cand.job_id] = f"{WAITING_FOR_ROOM} for {cand.num_workers} x {cand.per_worker}"
            starving = reserve_after_seconds is not None and now - cand.seq >= reserve_after_seconds
            if not backfill or starving:
                holder = cand
            continue
        by_id = {n.node_id: n for n in free_nodes}
        for node_id in placed:
            resources.take(by_id[node_id].free, cand.per_worker)
        q_usage.add(cand.total())
        result.admit.append(cand.job_id)
    return result


def pick(candidates: list[Candidate], nodes: list[NodeFree], *, backfill: bool = True) -> list[str]:
    """The job ids `plan` admits, for callers that need no reasons or limits."""
    return plan(candidates, nodes, backfill=backfill).admit


@dataclass(frozen=True)
class Running:
    """An admitted job as preemption sees it."""

    job_id: str
    priority: int
    seq: float  # creation time: among equals, the newest yields first
    total: dict[str, float]
    yielding: bool = False  # already asked to yield
    queue: str = "default"


def preemption(
    result: Plan, candidates: list[Candidate], running: list[Running], free: dict[str, float],
    *, limits: dict[str, QueueLimit] | None = None,
) -> tuple[Candidate, list[str]] | None:  # fmt: skip
    """Which running jobs should yield, and to whom: the first queued job (in admission order) that waits for room, in
    a queue that allows preemption, gets lower-priority jobs of its own queue stopped, lowest priority first and newest
    first, until the freed room could hold its whole group. Never a job of another queue (whatever its priority), nor
    one of equal or higher priority. One preemption at a time: None while an earlier one is in flight, and None when
    stopping every lower-priority job of its queue would still not make room.
    """
    limits = limits or {}
    blocked = next(
        (c for c in order(candidates) if result.waiting.get(c.job_id, "").startswith(WAITING_FOR_ROOM)), None
    )
    if blocked is None or not limits.get(blocked.queue, QueueLimit()).preemption:
        return None
    if any(r.yielding for r in running):
        return None
    need, room = blocked.total(), dict(free)
    victims: list[str] = []
    eligible = (r for r in running if r.queue == blocked.queue and r.priority < blocked.priority)
    for job in sorted(eligible, key=lambda r: (r.priority, -r.seq)):
        if resources.fits(room, need):
            break
        victims.append(job.job_id)
        for key, value in job.total.items():
            room[key] = room.get(key, 0.0) + value
    if not victims or not resources.fits(room, need):
        return None
    return blocked, victims
