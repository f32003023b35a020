"""One admission pass's decisions, in the order they are made: the one sequence that the dispatcher's admission
(`service.dispatch.admission.admit`) and the start-time forecast (`service.policy.forecast`) both run. Pure.

1. the fair order of the queued jobs read (`fairshare.fair_order`);
2. the plan: what starts, where, at what size, and why the rest wait (`scheduler.plan`: limits, quotas, cohorts,
   reservations, backfill);
3. lenders take back lent quota (`scheduler.reclaim`); if none does, one preemption by priority
   (`scheduler.preemption`), unless `may_preempt` says its room is on its way (the autoscaler's grace);
4. if nobody was asked to yield, running elastic jobs grow into the room left (`growth.grow`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from service.policy import fairshare, growth, quotas, scheduler
from service.policy.fairshare import FairShare, Usage
from service.policy.quotas import Held, QueueLimit, Quotas, Scope

RECLAIM_WHY = "to take back the quota its queue lent"


@dataclass(frozen=True)
class Growth:
    """Growth's settings (`SHUNTER_ELASTIC_GROW_*`) and the running elastic jobs below their max."""

    after_seconds: float
    min_gain: float
    jobs: Sequence[growth.Growable] = ()


@dataclass(frozen=True)
class Rules:
    """What constrains a pass besides room: queue limits, quotas and what is held against them."""

    fair: FairShare = FairShare()
    limits: dict[str, QueueLimit] = field(default_factory=dict)
    quotas: Quotas = Quotas()
    held: dict[Scope, Held] = field(default_factory=dict)
    gpu_hours: dict[Scope, float] = field(default_factory=dict)
    reserve_after_seconds: float | None = None


@dataclass
class Pass:
    ordered: list[scheduler.Candidate]
    plan: scheduler.Plan
    served: list[tuple[scheduler.Candidate, list[str]]]  # each job served by a preemption, and its victims
    why: str  # what the victims are told: RECLAIM_WHY, or "" (a preemption by priority)
    grown: dict[str, int]  # running elastic job id -> the size it is to restart at


def run(
    candidates: list[scheduler.Candidate],
    nodes: list[scheduler.NodeFree],
    *,
    rules: Rules,
    usage: Usage,
    holding: Sequence[fairshare.Holding],
    running: list[scheduler.Running],
    room: dict[str, float],
    now: float,
    planned: Callable[[list[scheduler.Candidate], scheduler.Plan], None] | None = None,
    may_preempt: Callable[[str], bool] | None = None,
    grow: Growth | None = None,
) -> Pass:
    """The pass's decisions (see the module docstring). `nodes`: each node's free room; `room`: the cluster's free room
    in all (what preemption counts); `running`: the admitted jobs; `holding`: what they hold, for fair order.
    `planned(ordered, plan)` is called once the plan is made, before any preemption (the autoscaler's demand is read
    from it, and `may_preempt` reads that demand)."""
    ordered = fairshare.fair_order(candidates, usage, rules.fair, holding)
    plan = scheduler.plan(candidates, nodes, limits=rules.limits, held=rules.held, rules=rules.quotas,
                          gpu_hours=rules.gpu_hours, ordered=ordered, now=now,
                          reserve_after_seconds=rules.reserve_after_seconds)  # fmt: skip
    if planned is not None:
        planned(ordered, plan)
    free = dict(room)
    served = scheduler.reclaim(plan, ordered, running, free, limits=rules.limits, held=rules.held)
    why = RECLAIM_WHY
    if not served:
        chosen = scheduler.preemption(plan, candidates, running, free, limits=rules.limits)
        if chosen is not None and may_preempt is not None and not may_preempt(chosen[0].job_id):
            chosen = None
        served, why = ([chosen] if chosen is not None else []), ""
    grown: dict[str, int] = {}
    if not served and grow is not None and grow.jobs:
        waiting = [c.priority for c in candidates if c.job_id in plan.waiting]

        def check(cand: scheduler.Candidate, extra: dict[str, float]) -> str | None:
            held = {scope: Held(h.running, h.cpus, h.gpus) for scope, h in plan.held.items()}
            for scope in quotas.scopes(cand.queue, cand.owner, cand.team):  # the growing job already runs: not one more
                if scope in held:
                    held[scope].running -= 1
            return quotas.check(extra, cand.queue, cand.owner, cand.team, limits=rules.limits, quotas=rules.quotas,
                                held=held)  # fmt: skip

        grown = growth.grow(list(grow.jobs), plan.left, waiting=waiting, after_seconds=grow.after_seconds,
                            min_gain=grow.min_gain, check=check)  # fmt: skip
    return Pass(ordered, plan, served, why, grown)
