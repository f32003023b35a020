"""When will each queued job start? A forward replay of admission itself. Pure: no I/O, no clock.

The replay runs the service's own admission pass (`service.policy.admission_pass`: fair order, the plan with every
queue limit, quota and cohort, reclaim, preemption and elastic growth, as the dispatcher runs it) on a model of the
cluster, from now on, one event at a time: a running job's expected end, a preempted (or growing) job's grace running
out, a retry backoff ending, a projected submission. At each event it admits what the real pass would admit
(reading, as it does, only the first `admit_batch` queued jobs, shared among the owners), and a job's estimated start
is the first event at which it is admitted. Between events each running job adds its decayed usage
(`fairshare.decayed`), so the fair order moves as it would.

A replay of only the jobs queued now is early whenever owners keep submitting: with fair share, a job submitted
later by an owner who used less goes ahead of one waiting now. So each owner who submitted lately is projected to go
on submitting at its recent rate (`Arrivals`: the jobs it submitted in the window, in turn, one every
`every` seconds). A projected job is a competitor only, never reported; an owner keeps at most
`MAX_PROJECTED_WAITING` of them waiting at once, which is all the fair order needs to see it as still waiting; jobs
with no end known (no timeout) are not projected, as one would hold its room for ever.

Each job holds its resources for its expected run: its timeout scaled by how long its owner's recent jobs ran
against theirs (`Waiter.duration`, computed by `service.estimate`), or with no end known (no timeout), in which case
what it holds is never freed and jobs that need it get no estimate (None, never a made-up time). Jobs are placed on
per-node room (`scheduler.place`); jobs running now are taken off the nodes roomiest first, as admission counts a job
Ray has not placed yet.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from service.core import resources
from service.policy import admission_pass, fairshare, growth, scheduler
from service.policy.fairshare import FairShare, Usage
from service.policy.quotas import Held, QueueLimit, Quotas, Scope, count

MAX_PROJECTED_WAITING = 2  # projected submissions an owner keeps waiting at once
# A replay that has not placed every job within this many events (per queued job, and a floor) leaves the rest
# without an estimate: a job that starves (no `reserve_after_seconds`) behind a stream of smaller ones never ends it.
EVENTS_PER_JOB, MIN_EVENTS = 10, 1000
HORIZON_SECONDS = 90 * 24 * 3600.0  # and none is estimated further out than this


@dataclass(frozen=True)
class Waiter:
    """A queued job (or a projected one) as the replay sees it."""

    cand: scheduler.Candidate
    duration: float | None  # how long it runs once started; None: no end known
    not_before: float = 0.0  # a retry backoff
    projected: bool = False


@dataclass
class Runner:
    """A job holding resources: running now, or started by the replay."""

    job_id: str
    owner: str
    team: str | None
    queue: str
    priority: int
    seq: float
    total: dict[str, float]
    end: float | None  # None: no end known
    yielding: bool = False
    held: list[tuple[str, dict[str, float]]] = field(default_factory=list)  # (node id, amount) it holds
    rest: Waiter | None = None  # what goes back to the queue when it stops (asked to yield)
    cand: scheduler.Candidate | None = None  # its worker group (an elastic one's whole range), to queue again with
    size: int | None = None  # workers it runs with (an elastic job: within its range)
    started: float | None = None  # when its attempt started: growth waits `grow_after_seconds` from it


@dataclass(frozen=True)
class Arrivals:
    """An owner's projected submissions: `templates` in turn, the first at `first`, then one every `every` s."""

    owner: str
    first: float
    every: float
    templates: tuple[Waiter, ...]


@dataclass(frozen=True)
class Policy:
    fair: FairShare = FairShare()
    limits: dict[str, QueueLimit] = field(default_factory=dict)
    rules: Quotas = Quotas()
    gpu_hours: dict[Scope, float] = field(default_factory=dict)
    reserve_after_seconds: float | None = None
    grace_seconds: float = 60.0
    admit_batch: int = 64  # queued jobs one pass reads (`SHUNTER_ADMIT_BATCH`)
    grow: bool = False  # running elastic jobs grow into free room (`SHUNTER_ELASTIC_GROW*`)
    grow_after_seconds: float = 600.0
    grow_min_gain: float = 0.0


def forecast(
    queued: Sequence[Waiter],
    running: Sequence[Runner],
    nodes: dict[str, dict[str, float]],
    now: float,
    *,
    usage: Usage | None = None,
    policy: Policy | None = None,
    arrivals: Sequence[Arrivals] = (),
    max_events: int | None = None,
) -> dict[str, float | None]:
    """Each queued (not projected) job's estimated start, in seconds of the same clock as `now`; None where the
    replay never admits it. `nodes`: each node's total resources."""
    policy = policy or Policy()
    usage = Usage(dict(usage.teams), dict(usage.owners)) if usage is not None else Usage()
    free = {node: dict(total) for node, total in nodes.items()}
    live = [replace(r, held=[]) for r in running]
    for runner in live:
        runner.held = _take_spread(free, runner.total)
    pending = _Queue(policy)
    for waiter in queued:
        pending.add(waiter)
    open_ = {w.cand.job_id for w in queued if not w.projected}
    starts: dict[str, float | None] = dict.fromkeys(open_)
    feed = _Feed(arrivals, now)
    capacity = resources.sum_of(nodes.values())
    max_events = max_events or MIN_EVENTS + EVENTS_PER_JOB * len(queued)
    t, events, forever = now, 0, None
    while open_ and events < max_events and t - now <= HORIZON_SECONDS:
        events += 1
        # What is held with no end known is never freed: a job that needs more than the rest never starts.
        endless = resources.sum_of(r.total for r in live if r.end is None)
        if endless != forever:
            forever, left = endless, dict(capacity)
            resources.take(left, endless)
            open_ -= {j for j in open_ if not resources.fits(left, pending.get(j).cand.total())}
        for runner in [r for r in live if r.end is not None and r.end <= t]:  # overdue ones end now
            live.remove(runner)
            for node, amount in runner.held:
                resources.give(free[node], amount)
            if runner.rest is not None:
                pending.add(runner.rest)
        for waiter in feed.due(t, pending):
            pending.add(waiter)
        for job_id in _admit(pending, live, free, t, usage, policy):
            if job_id in open_:
                starts[job_id] = t
                open_.discard(job_id)
        nxt = _next_event(t, live, pending, feed)
        if nxt is None:
            break
        _accrue(usage, live, t, nxt, policy.fair)
        t = nxt
    return starts


class _Queue:
    """The waiting jobs, each owner's in admission order (priority, then FIFO), so that a pass reads only the heads
    the real pass reads (`service.lifecycle.leases.queued_heads`: `batch / owners` of each owner, at least 4; without
    fair share the first `batch` of all), whatever the queue's depth."""

    def __init__(self, policy: Policy) -> None:
        self._fair, self._batch = policy.fair.enabled, policy.admit_batch
        self._jobs: dict[str, Waiter] = {}
        self._owners: dict[str, list[tuple[int, float, str]]] = {}
        self._backoffs: list[tuple[float, str]] = []  # (not_before, job id), a heap
        self.projected: dict[str, int] = {}  # owner -> projected jobs waiting

    def get(self, job_id: str) -> Waiter:
        return self._jobs[job_id]

    def add(self, waiter: Waiter) -> None:
        cand = waiter.cand
        self._jobs[cand.job_id] = waiter
        bisect.insort(self._owners.setdefault(cand.owner, []), (-cand.priority, cand.seq, cand.job_id))
        if waiter.not_before:
            heapq.heappush(self._backoffs, (waiter.not_before, cand.job_id))
        if waiter.projected:
            self.projected[cand.owner] = self.projected.get(cand.owner, 0) + 1

    def pop(self, job_id: str) -> Waiter:
        waiter = self._jobs.pop(job_id)
        cand = waiter.cand
        keys = self._owners[cand.owner]
        keys.pop(bisect.bisect_left(keys, (-cand.priority, cand.seq, cand.job_id)))
        if not keys:
            del self._owners[cand.owner]
        if waiter.projected:
            self.projected[cand.owner] -= 1
        return waiter

    def heads(self, t: float) -> list[Waiter]:
        """What the admission pass at `t` reads: past any backoff, each owner's first, as the real pass reads them."""
        ready: dict[str, list[Waiter]] = {}
        for owner, keys in self._owners.items():
            first = []
            for _, _, job_id in keys:  # no owner gives more than the whole batch: read no further
                waiter = self._jobs[job_id]
                if waiter.not_before <= t:
                    first.append(waiter)
                    if len(first) >= self._batch:
                        break
            if first:
                ready[owner] = first
        if not self._fair or len(ready) <= 1:
            merged = sorted((w for ws in ready.values() for w in ws),
                            key=lambda w: (-w.cand.priority, w.cand.seq, w.cand.job_id))  # fmt: skip
            return merged[: self._batch]
        each = max(4, self._batch // len(ready))
        return [w for ws in ready.values() for w in ws[:each]]

    def next_backoff(self, t: float) -> float | None:
        """The first backoff of a waiting job that ends after `t`."""
        heap = self._backoffs
        while heap and (heap[0][1] not in self._jobs or heap[0][0] <= t):
            heapq.heappop(heap)
        return heap[0][0] if heap else None


class _Feed:
    """Projected submissions, in time order. An owner that already has `MAX_PROJECTED_WAITING` projected jobs
    waiting takes none: its next submissions come only once one of those starts (an owner that submits a thousand
    jobs an hour costs the replay no more events than one that submits ten)."""

    def __init__(self, arrivals: Sequence[Arrivals], now: float) -> None:
        # A job without a known end would hold its room for ever: projecting one would bury every estimate.
        arrivals = [replace(a, templates=tuple(w for w in a.templates if w.duration is not None)) for a in arrivals]
        self._arrivals = [a for a in arrivals if a.templates and a.every > 0 and math.isfinite(a.every)]
        self._next = [max(a.first, now) for a in self._arrivals]
        self._count = [0] * len(self._arrivals)

    def next_time(self, pending: _Queue) -> float | None:
        times = [at for a, at in zip(self._arrivals, self._next, strict=True)
                 if pending.projected.get(a.owner, 0) < MAX_PROJECTED_WAITING]  # fmt: skip
        return min(times) if times else None

    def due(self, t: float, pending: _Queue) -> list[Waiter]:
        out: list[Waiter] = []
        for i, a in enumerate(self._arrivals):
            while self._next[i] <= t:
                at = self._next[i]
                if pending.projected.get(a.owner, 0) + sum(1 for w in out if w.cand.owner == a.owner) >= (
                    MAX_PROJECTED_WAITING
                ):
                    self._next[i] = at + a.every * (math.floor((t - at) / a.every) + 1)  # the first slot after t
                    break
                k = self._count[i]
                template = a.templates[k % len(a.templates)]
                out.append(Waiter(replace(template.cand, job_id=f"~{a.owner}~{k}", seq=at), template.duration,
                                  projected=True))  # fmt: skip
                self._count[i], self._next[i] = k + 1, at + a.every
        return out


def _admit(
    pending: _Queue, live: list[Runner], free: dict[str, dict[str, float]], t: float, usage: Usage, policy: Policy
) -> list[str]:
    """One admission pass at `t`: the dispatcher's own sequence (`service.policy.admission_pass`); starts what it
    admits and asks its victims, and the jobs it grows, to yield. Returns the ids admitted."""
    ready = pending.heads(t)
    if not ready and not (policy.grow and any(_growable(r) for r in live)):
        return []
    cands = [w.cand for w in ready]
    held: dict[Scope, Held] = {}
    for r in live:
        count(held, r.total, r.queue, r.owner, r.team)
    by_id = {r.job_id: r for r in live}  # the victims are among these: jobs admitted before this pass
    growth_ = None
    if policy.grow:
        jobs = [growth.Growable(r.cand, r.size or 0, t - (r.started or t)) for r in live if _growable(r) and r.cand]
        growth_ = admission_pass.Growth(policy.grow_after_seconds, policy.grow_min_gain, jobs)
    pass_ = admission_pass.run(
        cands, [scheduler.NodeFree(n, dict(room)) for n, room in free.items()],
        rules=admission_pass.Rules(fair=policy.fair, limits=policy.limits, quotas=policy.rules, held=held,
                                   gpu_hours=policy.gpu_hours, reserve_after_seconds=policy.reserve_after_seconds),
        usage=usage,
        holding=[fairshare.Holding(r.owner, r.team, r.total, r.cand.run_seconds if r.cand else None) for r in live],
        running=[scheduler.Running(r.job_id, r.priority, r.seq, r.total, yielding=r.yielding, queue=r.queue)
                 for r in live],
        room=resources.sum_of(free.values()), now=t, grow=growth_,
    )  # fmt: skip
    decision = pass_.plan
    started = []
    for job_id in decision.admit:
        waiter = pending.pop(job_id)
        cand = waiter.cand
        if decision.sizes.get(job_id, cand.num_workers) != cand.num_workers:  # an elastic job, at the size it got
            cand = replace(cand, num_workers=decision.sizes[job_id])
        placed = scheduler.place(cand, [scheduler.NodeFree(n, dict(f)) for n, f in free.items()])
        if placed is None:  # plan placed it on the same room: cannot happen, but never over-commit
            pending.add(waiter)
            continue
        started.append(job_id)
        for node in placed:
            resources.take(free[node], cand.per_worker)
        end = None if waiter.duration is None else t + waiter.duration
        live.append(Runner(job_id, cand.owner, cand.team, cand.queue, cand.priority, cand.seq, cand.total(), end,
                           held=[(node, dict(cand.per_worker)) for node in placed], cand=waiter.cand,
                           size=cand.num_workers, started=t))  # fmt: skip
    for victim_id in [v for _, victims in pass_.served for v in victims] + list(pass_.grown):
        _yield(by_id[victim_id], t, policy.grace_seconds)
    return started


def _growable(r: Runner) -> bool:
    """A running elastic job below its range's max, not asked to yield: one that growth may ask to grow."""
    return r.cand is not None and r.cand.elastic and not r.yielding and (r.size or 0) < r.cand.num_workers


def _yield(runner: Runner, t: float, grace: float) -> None:
    """A job asked to yield stops when its grace runs out (if it would not end before) and queues again for the rest
    of its run, at its old place in the FIFO (it resumes from the checkpoint it takes on notice)."""
    runner.yielding = True
    stop = t + grace
    if runner.end is not None and runner.end <= stop:
        return
    left = None if runner.end is None else runner.end - t
    cand = runner.cand or scheduler.Candidate(runner.job_id, runner.priority, runner.seq, 1, runner.total, "pack",
                                              runner.queue, runner.owner, runner.team)  # fmt: skip
    runner.end, runner.rest = stop, Waiter(cand, left, not_before=stop, projected=True)


def _next_event(t: float, live: list[Runner], pending: _Queue, feed: _Feed) -> float | None:
    """The next time something can change; None when nothing ever frees room again (a projected submission only
    takes room, and time alone only makes a starving job hold the rest back)."""
    times = [r.end for r in live if r.end is not None and r.end > t]
    backoff = pending.next_backoff(t)
    if backoff is not None:
        times.append(backoff)
    if not times:
        return None
    arrival = feed.next_time(pending)
    if arrival is not None and arrival > t:
        times.append(arrival)
    return min(times)


def _accrue(usage: Usage, live: list[Runner], t: float, until: float, fair: FairShare) -> None:
    """Fair-share usage from `t` to `until`: what was decays, what runs adds."""
    if not fair.enabled or until <= t:
        return
    factor = math.exp(-(until - t) * math.log(2) / fair.half_life_seconds)
    for book in (usage.teams, usage.owners):
        for key in book:
            book[key] *= factor
    for r in live:
        usage.add(r.owner, r.team, fairshare.decayed(fair.rate(r.total), t, until, until, fair.half_life_seconds))


def _take_spread(free: dict[str, dict[str, float]], need: dict[str, float]) -> list[tuple[str, dict[str, float]]]:
    """`resources.take_spread` on the nodes' room, returning what it took from each node (to give back at the end)."""
    before = {node: dict(room) for node, room in free.items()}
    resources.take_spread(list(free.values()), need)
    out = []
    for node, room in free.items():
        taken = {k: before[node].get(k, 0.0) - v for k, v in room.items() if before[node].get(k, 0.0) != v}
        if taken:
            out.append((node, taken))
    return out
