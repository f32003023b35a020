"""Admission policy: which queued jobs start now. Pure: no I/O, no clock; table-driven tests cover it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from service.core import resources
from service.policy import quotas
from service.policy.quotas import Held, QueueLimit, QueueUsage, Quotas, Scope

__all__ = ["Candidate", "Held", "NodeFree", "Plan", "QueueLimit", "QueueUsage", "Running", "plan", "preemption"]

WAITING_FOR_ROOM = "waiting for room"  # the start of the reason preemption looks for


@dataclass(frozen=True)
class Candidate:
    """A queued job as the policy sees it: its worker group, its place in the order, who it counts against."""

    job_id: str
    priority: int
    seq: float  # FIFO key within a priority (creation time, seconds)
    num_workers: int
    per_worker: dict[str, float]
    placement: str = "pack"  # pack | spread | strict_pack | strict_spread
    queue: str = "default"
    owner: str = "anonymous"
    team: str | None = None
    run_seconds: float | None = None  # its timeout: the longest it can run once started (fair share's projection)
    min_workers: int | None = None  # an elastic group: starts at any size in [min_workers, num_workers]
    excluded: frozenset[str] = frozenset()  # nodes its workers are kept off (service.policy.exclusion)
    # Since when it could start (seconds): its last dependency's end for a job with depends_on, else its creation. The
    # starvation guard counts from here: a job that waited on its dependencies has not waited for room.
    ready_since: float | None = None

    def total(self) -> dict[str, float]:
        return resources.scaled(self.per_worker, self.num_workers)

    def least(self) -> dict[str, float]:
        """What it needs to start: its whole group, or an elastic group's min."""
        return resources.scaled(self.per_worker, self.min_workers or self.num_workers)

    @property
    def elastic(self) -> bool:
        return self.min_workers is not None and self.min_workers < self.num_workers


@dataclass
class Plan:
    admit: list[str] = field(default_factory=list)
    waiting: dict[str, str] = field(default_factory=dict)  # job id -> why it waits, for `state_reason`
    sizes: dict[str, int] = field(default_factory=dict)  # job id -> workers it starts with (elastic jobs)
    left: list[NodeFree] = field(default_factory=list)  # the room still free once the admitted jobs are placed
    held: dict[Scope, Held] = field(default_factory=dict)  # what admitted jobs hold by scope, these ones included


@dataclass
class NodeFree:
    node_id: str
    free: dict[str, float] = field(default_factory=dict)


def place(candidate: Candidate, nodes: list[NodeFree]) -> list[str] | None:
    """Node ids for each worker, or None if the whole group cannot be placed now. Never a partial group.

    pack fills the fullest-fitting nodes first; spread puts each worker on the node with most room;
    strict_pack needs one node for all; strict_spread needs a distinct node per worker. Nodes the candidate is
    kept off (`excluded`) are not used.
    """
    free = {n.node_id: dict(n.free) for n in nodes if n.node_id not in candidate.excluded}
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


def sized(
    cand: Candidate, nodes: list[NodeFree], check: Callable[[dict[str, float]], str | None]
) -> tuple[Candidate, list[str] | None, str | None]:
    """The candidate at the size it starts with, its placement (None: no room), and the quota or limit it is over
    (None: within all). A rigid group has one size; an elastic one gets the most workers in [min, max] that both fit
    and stay within `check`, by bisection (both only get harder as the group grows), or, if even its min does not,
    its min with the reason."""

    def at(n: int) -> tuple[Candidate, list[str] | None, str | None]:
        c = cand if n == cand.num_workers else replace(cand, num_workers=n)
        reason = check(c.total())
        return c, (None if reason else place(c, nodes)), reason

    if not cand.elastic:
        return at(cand.num_workers)
    best = at(cand.min_workers or 1)
    if best[1] is None:
        return best
    lo, hi = (cand.min_workers or 1) + 1, cand.num_workers
    while lo <= hi:
        mid = (lo + hi) // 2
        tried = at(mid)
        if tried[1] is not None:
            best, lo = tried, mid + 1
        else:
            hi = mid - 1
    return best


def order(candidates: list[Candidate]) -> list[Candidate]:
    """Higher priority first, FIFO within a priority (fair share off)."""
    return sorted(candidates, key=lambda c: (-c.priority, c.seq, c.job_id))


def plan(
    candidates: list[Candidate],
    nodes: list[NodeFree],
    *,
    limits: dict[str, QueueLimit] | None = None,
    usage: dict[str, QueueUsage] | None = None,
    held: dict[Scope, Held] | None = None,
    rules: Quotas | None = None,
    gpu_hours: dict[Scope, float] | None = None,
    ordered: list[Candidate] | None = None,
    now: float = 0.0,
    reserve_after_seconds: float | None = None,
    backfill: bool = True,
) -> Plan:
    """The job ids to admit now, in order, each with room for its whole worker group; and why the rest wait.

    `ordered`: the candidates in admission order (`service.policy.fairshare.fair_order`); default: higher priority
    first, FIFO within a priority. `rules`: per-owner/per-team quotas. Every limit (`service.policy.quotas.check`)
    counts what admitted jobs hold (`held` by scope, or per queue as `usage`) plus what this pass admits. With backfill
    a later job may start in room an earlier one cannot use yet, until that earlier one has waited
    `reserve_after_seconds`: from then on nothing behind it starts, so the room it needs is kept for it as running jobs
    end (bounded wait instead of starvation).
    """
    limits = limits or {}
    rules = rules or Quotas()
    scoped = _copied(held or {})
    for queue, used in (usage or {}).items():
        scoped[("queue", queue)] = Held(used.running, used.cpus, used.gpus)
    free_nodes = [NodeFree(n.node_id, dict(n.free)) for n in nodes]
    result = Plan()
    holder: Candidate | None = None
    for cand in ordered if ordered is not None else order(candidates):
        if holder is not None:
            result.waiting[cand.job_id] = f"held behind {holder.job_id}, which has waited longest for room"
            continue

        def check(total: dict[str, float], cand: Candidate = cand) -> str | None:
            return quotas.check(total, cand.queue, cand.owner, cand.team, limits=limits, quotas=rules, held=scoped,
                                gpu_hours=gpu_hours)  # fmt: skip

        cand, placed, reason = sized(cand, free_nodes, check)
        total = cand.total()
        if reason:
            result.waiting[cand.job_id] = reason
            continue
        if placed is None:
            result.waiting[cand.job_id] = f"{WAITING_FOR_ROOM} for {cand.num_workers} x {cand.per_worker}"
            since = cand.seq if cand.ready_since is None else cand.ready_since
            starving = reserve_after_seconds is not None and now - since >= reserve_after_seconds
            if not backfill or starving:
                holder = cand
            continue
        by_id = {n.node_id: n for n in free_nodes}
        for node_id in placed:
            resources.take(by_id[node_id].free, cand.per_worker)
        quotas.count(scoped, total, cand.queue, cand.owner, cand.team)
        result.admit.append(cand.job_id)
        result.sizes[cand.job_id] = cand.num_workers
    result.left, result.held = free_nodes, scoped
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
    need, room = blocked.least(), dict(free)
    victims: list[str] = []
    eligible = (r for r in running if r.queue == blocked.queue and r.priority < blocked.priority)
    for job in sorted(eligible, key=lambda r: (r.priority, -r.seq)):
        if resources.fits(room, need):
            break
        victims.append(job.job_id)
        resources.give(room, job.total)
    if not victims or not resources.fits(room, need):
        return None
    return blocked, victims


def reclaim(
    result: Plan, ordered: list[Candidate], running: list[Running], free: dict[str, float],
    *, limits: dict[str, QueueLimit], held: dict[Scope, Held],
) -> list[tuple[Candidate, list[str]]]:  # fmt: skip
    """Lenders take back their lent quota, all at once: each queued job (in admission order) of a cohort queue that
    waits (for room, or for its cohort's idle quota) although its queue, with the lenders' jobs served before it,
    would stay within its nominal quota, gets jobs of the cohort's other queues stopped, newest first, each only
    while its queue holds more than its nominal quota (it is borrowing), until the freed room and the cohort's idle
    quota hold the job. Returns each served job with its victims. Stops at the first lender that cannot be served
    (a later, smaller one does not overtake it). Priority does not count: borrowed quota is lent, not owned.

    One pass serves every lender job it can, so that the quota comes back in one preemption cycle, not one cycle
    per waiting job; while an earlier preemption is in flight, nothing (like `preemption`)."""
    if any(r.yielding for r in running):
        return []
    scoped = _copied(held)
    room = dict(free)
    taken: set[str] = set()
    out: list[tuple[Candidate, list[str]]] = []
    for cand in ordered:
        why = result.waiting.get(cand.job_id, "")
        limit = limits.get(cand.queue)
        if limit is None or limit.cohort is None or not why.startswith(WAITING_FOR_ROOM):
            continue
        need, mine = cand.least(), scoped.get(("queue", cand.queue), Held())
        capped = [r for r, _, _ in quotas.RESOURCES if limit.nominal(r) is not None and need.get(r, 0.0) > 0]
        if not capped or any(mine.of(r) + need.get(r, 0.0) > (limit.nominal(r) or 0.0) + 1e-9 for r in capped):
            continue  # not a lender asking back its own quota
        trial = _copied(scoped)
        space, victims = dict(room), []
        members = [
            r for r in running
            if r.queue != cand.queue and r.job_id not in taken
            and limits.get(r.queue, QueueLimit()).cohort == limit.cohort
        ]  # fmt: skip
        for job in sorted(members, key=lambda r: -r.seq):
            if _fits_cohort(space, need, cand.queue, limits, trial, capped):
                break
            if not any(quotas.borrowed(job.queue, r, limits, trial) > 1e-9 for r in capped):
                continue
            victims.append(job.job_id)
            trial.setdefault(("queue", job.queue), Held()).add(job.total, -1)
            resources.give(space, job.total)
        if not (victims and _fits_cohort(space, need, cand.queue, limits, trial, capped)):
            break  # the first lender that cannot be served now holds the rest back
        # Served: its victims go, and it counts as admitted (room and quota) for the lenders after it.
        taken.update(victims)
        trial.setdefault(("queue", cand.queue), Held()).add(need, 1)
        resources.take(space, need)
        scoped, room = trial, space
        out.append((cand, victims))
    return out


def _copied(held: dict[Scope, Held]) -> dict[Scope, Held]:
    """A copy the caller may count into without changing `held`."""
    return {k: Held(v.running, v.cpus, v.gpus) for k, v in held.items()}


def _fits_cohort(
    room: dict[str, float], need: dict[str, float], queue: str, limits: dict[str, QueueLimit],
    held: dict[Scope, Held], capped: list[str],
) -> bool:  # fmt: skip
    cohort = limits[queue].cohort or ""
    for resource in capped:
        if need.get(resource, 0.0) > quotas.cohort_idle(cohort, resource, limits, held) + 1e-9:
            return False
    return resources.fits(room, need)
