"""What to ask a growing cluster's autoscaler for (issue 37). Pure: queue, cluster and node types in, bundles out.

A queued job is not a Ray task or placement group until shunter admits it, and shunter admits it only when the
cluster can hold its whole worker group, so Ray's autoscaler never sees it waiting. The dispatcher therefore asks
for it (`request_resources`): the worker-group bundles of the jobs that would start next if room existed, in
admission's own order (fair share, priorities), after quotas and queue caps, up to `max_jobs` of them.

Ray's autoscaler fits the requested bundles to the cluster's *total* capacity, ignoring what is in use: the
request holds the running jobs' bundles as well, or it adds nothing while the existing nodes are busy. A request
replaces the one before; an empty one withdraws it, and idle nodes go after the autoscaler's idle timeout.

What bundles cannot say: `strict_spread` (one worker per node) is asked for as separate bundles the autoscaler may
pack onto one node; its placement group then waits until nodes for the rest appear, which the next request (the
same bundles, the cluster now larger) asks for again. `strict_pack` is asked for as one bundle of the whole group.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime

from service.core import resources
from service.core.errors import InvalidSpec
from service.policy.scheduler import WAITING_FOR_ROOM, Candidate, NodeFree, place
from service.spec.job import Resources

HELD_BEHIND = "held behind "  # scheduler.plan's reason for a job behind one that waited longest for room


@dataclass(frozen=True)
class NodeType:
    """One kind of node the autoscaler can add (`SHUNTER_NODE_TYPES`): what each holds, and at most how many."""

    name: str
    resources: dict[str, float]
    max: int


@dataclass(frozen=True)
class Running:
    """An admitted job's worker group as it holds the cluster: `workers` bundles of `per_worker`."""

    job_id: str
    per_worker: dict[str, float]
    workers: int
    placement: str = "pack"


@dataclass
class Demand:
    """The request for the autoscaler, and the waiting jobs it asks room for (in admission order)."""

    bundles: list[dict[str, float]] = field(default_factory=list)
    jobs: list[str] = field(default_factory=list)

    def key(self) -> tuple[tuple[tuple[str, float], ...], ...]:
        """The request as a comparable value: the same bundles in any order are the same request."""
        return tuple(sorted(tuple(sorted(b.items())) for b in self.bundles))


def waits_for_room(reason: str | None) -> bool:
    """Whether a waiting job waits for room (more nodes would start it), not for a quota, a cap or its turn in a
    sweep: only those are asked for."""
    return reason is not None and (reason.startswith(WAITING_FOR_ROOM) or reason.startswith(HELD_BEHIND))


def bundles_of(per_worker: Mapping[str, float], workers: int, placement: str) -> list[dict[str, float]]:
    """A worker group as autoscaler bundles: one per worker, or one for the whole group under `strict_pack`."""
    if placement == "strict_pack":
        return [resources.scaled(per_worker, workers)]
    return [dict(per_worker) for _ in range(workers)]


def could_hold(cand: Candidate, node_types: Iterable[NodeType]) -> bool:
    """Whether the declared node types, at their maximum counts, could hold the candidate's smallest group."""
    least = cand if not cand.elastic else replace(cand, num_workers=cand.min_workers or 1, min_workers=None)
    grown = [NodeFree(f"{t.name}-{i}", dict(t.resources)) for t in node_types for i in range(max(0, t.max))]
    return place(least, grown) is not None


def demand(
    ordered: list[Candidate],
    waiting: Mapping[str, str],
    running: list[Running],
    *,
    max_jobs: int,
    node_types: list[NodeType] | None = None,
) -> Demand:
    """The bundles to ask for: every running group's, then the groups of the first `max_jobs` jobs of `ordered` that
    wait for room (`waiting`: job id -> why it waits, from the admission pass). A job no declared node type could
    hold is left out (with node types declared, submission refuses such a job; one queued before they were declared
    waits with its reason). Nothing waiting for room: no request at all, so idle nodes can go."""
    asked: list[Candidate] = []
    for cand in ordered:  # in the admission pass: the first `max_jobs` that qualify, not every waiting job
        if len(asked) >= max_jobs:
            break
        if waits_for_room(waiting.get(cand.job_id)) and (not node_types or could_hold(cand, node_types)):
            asked.append(cand)
    if not asked:
        return Demand()
    out = Demand()
    for run in running:
        out.bundles += bundles_of(run.per_worker, run.workers, run.placement)
    for cand in asked:
        out.bundles += bundles_of(cand.per_worker, cand.num_workers, cand.placement)
        out.jobs.append(cand.job_id)
    return out


def may_preempt(job_id: str, wanted: Demand, asked: Mapping[str, datetime], now: datetime, grace: float) -> bool:
    """Whether a job blocked for room may have others preempted for it now, on a cluster that may grow: not while the
    autoscaler is asked for its room and `grace` seconds have not passed since it first was (the room may come
    without stopping anyone); a job the request does not hold (past `max_jobs`), or one asked for longer, may."""
    if job_id not in wanted.jobs or grace <= 0:
        return True
    at = asked.get(job_id)
    return at is not None and (now - at).total_seconds() >= grace


def check_node_types(res: Resources, node_types: list[NodeType]) -> None:
    """At submission, with node types declared: refuse (422 naming `resources`) a group that no node type could hold
    even at its maximum count, since it would wait for ever."""
    cand = Candidate(job_id="", priority=0, seq=0.0, num_workers=res.max_workers, per_worker=res.per_worker(),
                     placement=res.placement.value, min_workers=res.min_workers if res.elastic else None)  # fmt: skip
    if could_hold(cand, node_types):
        return
    kinds = ", ".join(f"{t.name} (up to {t.max} of {t.resources})" for t in node_types)
    raise InvalidSpec(
        f"resources: no node type can hold {res.min_workers} workers of {cand.per_worker} with placement "
        f"{res.placement.value}, even at their maximum counts; the cluster's node types: {kinds}",
        field="resources",
    )


def accelerator_warning(res: Resources) -> str | None:
    """A warning for an accelerator type Ray does not name (`ray.util.accelerators`): a typo waits for a node type
    no autoscaler has. Never a refusal: a cluster may carry any custom type, and scaling from zero none is up yet."""
    if res.accelerator_type is None:
        return None
    from ray.util import accelerators  # read lazily: the control plane's first typed job pays for the import

    known = {v for k, v in vars(accelerators).items() if k.isupper() and isinstance(v, str)}
    if res.accelerator_type in known:
        return None
    return (f"resources.accelerator_type: {res.accelerator_type!r} is not one of Ray's accelerator names "
            f"(ray.util.accelerators: {', '.join(sorted(known)[:12])}, ...); it runs only on nodes that carry the "
            f"resource accelerator_type:{res.accelerator_type}")  # fmt: skip
