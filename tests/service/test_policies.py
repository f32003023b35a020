"""Pure policies: admission (scheduler.pick) and retry (retry.decide), table-driven."""

from __future__ import annotations

from dataclasses import replace

import pytest

from service.core.errors import InvalidSpec
from service.lifecycle.jobs import check_fits_cluster
from service.policy.retry import decide
from service.policy.scheduler import Candidate, NodeFree, pick, place
from service.spec.job import JobSpec
from service.store.models import ClusterSnapshot, EndReason


def cand(job_id: str, workers: int, cpu: float = 1.0, prio: int = 0, seq: float = 0.0, placement: str = "pack"):
    return Candidate(job_id, prio, seq, workers, {"CPU": cpu}, placement)


def nodes(*cpus: float) -> list[NodeFree]:
    return [NodeFree(f"n{i}", {"CPU": c}) for i, c in enumerate(cpus)]


@pytest.mark.parametrize(
    ("queued", "free", "admitted"),
    [
        ([cand("a", 2)], nodes(2), ["a"]),
        ([cand("a", 3)], nodes(2), []),  # never a partial group
        ([cand("a", 2, seq=1), cand("b", 2, seq=2)], nodes(2), ["a"]),  # FIFO: only one fits
        ([cand("a", 2, seq=2), cand("b", 2, seq=1)], nodes(2), ["b"]),
        ([cand("a", 2, prio=0, seq=1), cand("b", 2, prio=5, seq=2)], nodes(2), ["b"]),  # priority first
        ([cand("big", 4, seq=1), cand("small", 1, seq=2)], nodes(2), ["small"]),  # backfill past a blocked one
        ([cand("a", 2, cpu=1.5)], nodes(2, 2), ["a"]),  # one worker per node
        ([cand("a", 2, cpu=1.5)], nodes(2), []),  # a worker never spans nodes
        ([cand("a", 2, placement="strict_pack")], nodes(1, 1), []),
        ([cand("a", 2, placement="strict_spread")], nodes(4), []),
        ([cand("a", 2, placement="strict_spread")], nodes(1, 1), ["a"]),
        ([cand("a", 2), cand("b", 2, seq=1)], nodes(1, 1, 2), ["a", "b"]),
    ],
)
def test_pick(queued: list[Candidate], free: list[NodeFree], admitted: list[str]) -> None:
    assert pick(queued, free) == admitted


def test_pick_without_backfill_is_strict_order() -> None:
    assert pick([cand("big", 4, seq=1), cand("small", 1, seq=2)], nodes(2), backfill=False) == []


def test_spread_and_pack_placement() -> None:
    assert sorted(place(cand("a", 2, placement="spread"), nodes(4, 4))) == ["n0", "n1"]
    assert place(cand("a", 2, placement="pack"), nodes(4, 4)) in (["n0", "n0"], ["n1", "n1"])


@pytest.mark.parametrize(
    ("reason", "attempt", "max_attempts", "retry", "delay"),
    [
        (EndReason.WORKER_LOST, 1, 3, True, 10.0),
        (EndReason.NODE_LOST, 2, 3, True, 20.0),
        (EndReason.INFRA, 3, 3, False, 0.0),  # exhausted
        (EndReason.USER_ERROR, 1, 3, False, 0.0),  # deterministic: not retried
        (EndReason.TIMEOUT, 1, 3, False, 0.0),
        (EndReason.CANCELLED, 1, 3, False, 0.0),
        (EndReason.SUCCEEDED, 1, 3, False, 0.0),
        (EndReason.WORKER_LOST, 5, 10, True, 60.0),  # capped
        (EndReason.NODE_DRAINING, 1, 3, True, 0.0),  # checkpointed on notice: again at once
        (EndReason.NODE_DRAINING, 3, 3, True, 0.0),  # and not counted: even on the last attempt
        (EndReason.PREEMPTED, 3, 3, True, 0.0),
        (EndReason.STORAGE_TAMPERED, 1, 3, False, 0.0),  # its archive or checkpoint stays rewritten: not retried
    ],
)
def test_retry_decide(reason: EndReason, attempt: int, max_attempts: int, retry: bool, delay: float) -> None:
    d = decide(reason=reason, attempt=attempt, max_attempts=max_attempts, backoff_seconds=10, max_backoff_seconds=60)
    assert d.retry is retry
    assert d.delay_seconds == delay


@pytest.mark.parametrize(("attempt", "retry", "delay"), [(1, True, 10.0), (3, False, 0.0)])
def test_a_drain_ray_does_not_bear_out_is_a_counted_failure(attempt: int, retry: bool, delay: float) -> None:
    """A job's side claims node_draining, but no node is draining or gone: backoff, and it uses up max_attempts."""
    d = decide(reason=EndReason.NODE_DRAINING, attempt=attempt, max_attempts=3, backoff_seconds=10,
               max_backoff_seconds=60, drain_confirmed=False)  # fmt: skip
    assert (d.retry, d.delay_seconds) == (retry, delay)


@pytest.mark.parametrize(
    ("reason", "elastic", "confirmed", "uncounted"),
    [
        (EndReason.NODE_LOST, True, True, True),  # an elastic job shrinks onto what is left
        (EndReason.NODE_LOST, True, False, False),  # a lost node Ray does not bear out: a failure like any
        (EndReason.NODE_LOST, False, True, False),  # a rigid job: the usual counted retry
        (EndReason.WORKER_LOST, True, True, False),  # a worker (not its node) died: maybe the job's own doing
    ],
)  # fmt: skip
def test_an_elastic_job_that_loses_a_node_shrinks_instead_of_failing(
    reason: EndReason, elastic: bool, confirmed: bool, uncounted: bool
) -> None:
    d = decide(reason=reason, attempt=3, max_attempts=3, backoff_seconds=10, max_backoff_seconds=60,
               elastic=elastic, drain_confirmed=confirmed)  # fmt: skip
    assert (d.retry, d.uncounted, d.delay_seconds) == ((True, True, 0.0) if uncounted else (False, False, 0.0))


@pytest.mark.parametrize(("losses", "free"), [(0, True), (19, True), (20, False), (50, False)])
def test_free_retries_for_lost_or_drained_nodes_are_bounded(losses: int, free: bool) -> None:
    """Past max_free_node_losses earlier drained or lost-node attempts, a drain counts like any failure (backoff,
    and it uses up max_attempts): a job that takes its own node down cannot be retried without end."""
    for reason, elastic in ((EndReason.NODE_DRAINING, False), (EndReason.NODE_LOST, True)):
        d = decide(reason=reason, attempt=3, max_attempts=3, backoff_seconds=10, max_backoff_seconds=60,
                   elastic=elastic, node_losses=losses, max_free_node_losses=20)  # fmt: skip
        assert (d.retry, d.uncounted) == ((True, True) if free else (False, False)), (reason, losses)


def test_drained_attempts_do_not_use_up_max_attempts() -> None:
    """Attempts 1 and 2 ended on drain notices (counted in `preemptions`): a worker loss on attempt 3 of 2 allowed is
    the job's first failure, so it is retried; without the two drains it would be its third, and final."""
    kw = {"reason": EndReason.WORKER_LOST, "attempt": 3, "max_attempts": 2, "backoff_seconds": 1,
          "max_backoff_seconds": 1}  # fmt: skip
    assert decide(**kw, preemptions=2).retry
    assert not decide(**kw, preemptions=0).retry


# ---- queue limits and the starvation guard -------------------------------------------------------------------
from service.policy.scheduler import QueueLimit, QueueUsage, plan  # noqa: E402


def test_queue_limit_on_running_jobs_holds_the_rest_with_a_reason() -> None:
    cands = [cand("a", 1, seq=1), cand("b", 1, seq=2)]
    cands = [Candidate(c.job_id, 0, c.seq, 1, {"CPU": 1.0}, "pack", "research") for c in cands]
    result = plan(cands, nodes(8), limits={"research": QueueLimit(max_running=2)}, usage={"research": QueueUsage(1)})
    assert result.admit == ["a"]
    assert "limit of 2 running jobs" in result.waiting["b"]


def test_queue_gpu_and_cpu_caps() -> None:
    big = Candidate("g", 0, 1, 2, {"CPU": 1.0, "GPU": 2.0}, "pack", "q")
    free = [NodeFree("n0", {"CPU": 8, "GPU": 8})]
    assert plan([big], free, limits={"q": QueueLimit(max_gpus=3)}).admit == []
    assert plan([big], free, limits={"q": QueueLimit(max_gpus=4)}).admit == ["g"]
    assert "CPUs" in plan([big], free, limits={"q": QueueLimit(max_cpus=1)}).waiting["g"]


def test_other_queues_are_not_held_by_a_full_one() -> None:
    a = Candidate("a", 5, 1, 1, {"CPU": 1.0}, "pack", "full")
    b = Candidate("b", 0, 2, 1, {"CPU": 1.0}, "pack", "default")
    assert plan([a, b], nodes(4), limits={"full": QueueLimit(max_running=0)}).admit == ["b"]


@pytest.mark.parametrize(("waited", "admitted"), [(10.0, ["small"]), (400.0, [])])
def test_backfill_stops_once_the_blocked_job_has_waited_long_enough(waited: float, admitted: list[str]) -> None:
    """A big job blocked for longer than the reservation threshold keeps the room: small ones stop jumping ahead."""
    big = cand("big", 4, seq=0.0)
    small = cand("small", 1, seq=1.0)
    result = plan([big, small], nodes(2), now=waited, reserve_after_seconds=300)
    assert result.admit == admitted
    if not admitted:
        assert "held behind big" in result.waiting["small"]


@pytest.mark.parametrize(("ready_since", "admitted"), [(350.0, ["small"]), (50.0, [])])
def test_the_starvation_guard_counts_from_when_a_dependent_job_became_ready(ready_since: float, admitted: list[str]):
    """A job created long ago that waited on its dependencies (depends_on) has not waited for room: created at 0 and
    ready at 350, at 400 it has waited 50 s and small ones may still backfill; ready at 50, it has waited 350 s."""
    big = replace(cand("big", 4, seq=0.0), ready_since=ready_since)
    result = plan([big, cand("small", 1, seq=1.0)], nodes(2), now=400.0, reserve_after_seconds=300)
    assert result.admit == admitted


# ---- preemption: only lower-priority jobs of the blocked job's own queue -----------------------------------------
from service.policy.scheduler import Running, preemption  # noqa: E402


def running(job_id: str, prio: int, queue: str, cpu: float = 2.0, seq: float = 0.0) -> Running:
    return Running(job_id, prio, seq, {"CPU": cpu}, queue=queue)


@pytest.mark.parametrize(
    ("others", "victims"),
    [
        ([running("low", 0, "research")], ["low"]),  # same queue, lower priority: a victim
        ([running("low", 0, "default")], None),  # another queue: never, whatever its priority
        ([running("low", -1000, "batch")], None),
        ([running("peer", 5, "research")], None),  # equal priority: never
        ([running("high", 9, "research")], None),
        ([running("theirs", 0, "default"), running("ours", 1, "research")], ["ours"]),  # only from its own queue
        ([running("a", 1, "research", cpu=1, seq=1), running("b", 0, "research", cpu=1, seq=2),
          running("c", 0, "research", cpu=1, seq=3)], ["c", "b"]),  # lowest priority, newest first, only enough
        ([running("half", 0, "research", cpu=1), running("rest", 0, "default", cpu=1)], None),  # not enough in queue
    ],
)  # fmt: skip
def test_preemption_stays_in_its_own_queue(others: list[Running], victims: list[str] | None) -> None:
    blocked = Candidate("urgent", 5, 10.0, 1, {"CPU": 2.0}, "pack", "research")
    limits = {"research": QueueLimit(preemption=True), "default": QueueLimit(preemption=True)}
    result = plan([blocked], nodes(0), limits=limits)
    chosen = preemption(result, [blocked], others, {"CPU": 0.0}, limits=limits)
    assert (chosen[1] if chosen else None) == victims
    assert chosen is None or chosen[0] is blocked


@pytest.mark.parametrize(
    ("attempt", "restarts", "counted", "retry"),
    [
        (1, 0, False, True),  # lost with the head: retried though max_attempts is 1
        (3, 2, False, True),  # however often it happens, unless counted
        (1, 0, True, False),  # counted: the one attempt is used up
        (2, 1, True, False),
    ],
)
def test_a_head_restart_does_not_use_up_attempts_unless_counted(
    attempt: int, restarts: int, counted: bool, retry: bool
) -> None:
    decision = decide(reason=EndReason.CLUSTER_RESTARTED, attempt=attempt, max_attempts=1, backoff_seconds=5,
                      max_backoff_seconds=60, cluster_restarts=restarts, count_cluster_restarts=counted)  # fmt: skip
    assert decision.retry is retry


def test_attempts_a_head_restart_took_do_not_count_later_either() -> None:
    """A worker lost on attempt 3, after two attempts a head restart took: the job has used one of its two."""
    decision = decide(reason=EndReason.WORKER_LOST, attempt=3, max_attempts=2, backoff_seconds=1,
                      max_backoff_seconds=60, cluster_restarts=2)  # fmt: skip
    assert decision.retry


def _snapshot(*nodes: tuple[bool, dict[str, float]]) -> ClusterSnapshot:
    return ClusterSnapshot(id=1, nodes=[{"node_id": f"n{i}", "alive": alive, "total": total, "available": total}
                                        for i, (alive, total) in enumerate(nodes)])  # fmt: skip


@pytest.mark.parametrize(
    ("snapshot", "refused"),
    [
        (None, None),
        (_snapshot(), None),
        # A head just started lists its node before its resources: nothing is known yet, so nothing is refused.
        (_snapshot((True, {})), None),
        (_snapshot((False, {"CPU": 8.0}), (True, {})), None),
        (_snapshot((True, {"CPU": 2.0})), "resources.num_workers"),  # 3 workers of 1 CPU on 2 CPUs
        (_snapshot((True, {"CPU": 2.0}), (True, {})), "resources.num_workers"),
        (_snapshot((True, {"CPU": 3.0})), None),
        (_snapshot((True, {"CPU": 0.5})), "resources.resources_per_worker"),
    ],
)
def test_check_fits_cluster(snapshot: ClusterSnapshot | None, refused: str | None) -> None:
    spec = JobSpec.model_validate({"entrypoint": {"callable": "m:f"}, "resources": {"num_workers": 3}})
    if refused is None:
        check_fits_cluster(spec, snapshot)
    else:
        with pytest.raises(InvalidSpec) as caught:
            check_fits_cluster(spec, snapshot)
        assert caught.value.field == refused
