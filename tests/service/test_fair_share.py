"""Fair share, quotas and borrowing (issue 15), table-driven: the pure decisions (service.policy.fairshare,
service.policy.quotas, service.policy.scheduler's plan / reclaim / preemption), then what admission reads from the
database (service.store.standing) on a real SQLite file and a real PostgreSQL database."""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from service.policy import quotas
from service.policy.fairshare import FairShare, Holding, Usage, Use, decayed, fair_order, shares, usage_of
from service.policy.quotas import Held, QueueLimit, Quota, Quotas, Scope, check, parse_queue_limit
from service.policy.scheduler import Candidate, NodeFree, Plan, Running, plan, preemption, reclaim
from service.store import standing
from service.store.models import Attempt, Job, JobState

HOUR = 3600.0


def cand(
    job_id: str, owner: str = "alice", team: str | None = None, *, prio: int = 0, seq: float = 0.0,
    cpu: float = 1.0, gpu: float = 0.0, workers: int = 1, queue: str = "default",
) -> Candidate:  # fmt: skip
    per_worker = {"CPU": cpu, **({"GPU": gpu} if gpu else {})}
    return Candidate(job_id, prio, seq, workers, per_worker, "pack", queue, owner, team)


def ids(jobs: list[Candidate]) -> list[str]:
    return [c.job_id for c in jobs]


def nodes(cpus: float, gpus: float = 0.0) -> list[NodeFree]:
    return [NodeFree("n0", {"CPU": cpus, "GPU": gpus})]


# ---- decayed usage ----------------------------------------------------------------------------------------------


def numeric(rate: float, start: float, end: float, now: float, half_life: float, steps: int = 20_000) -> float:
    """Simpson's rule on rate * 2^-((now - t) / half_life) over [start, end]."""
    h = (end - start) / steps
    f = [rate * 2 ** (-(now - (start + i * h)) / half_life) for i in range(steps + 1)]
    return h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))


@pytest.mark.parametrize(
    ("rate", "start", "end", "now", "half_life"),
    [
        (1.0, 0.0, 3600.0, 3600.0, 3600.0),  # one half-life, ending now
        (10.0, 0.0, 600.0, 7200.0, 1800.0),  # long ended
        (14.0, 1000.0, 90_000.0, 100_000.0, 86_400.0),  # a day's half-life
        (0.5, -5000.0, 5000.0, 5000.0, 60.0),  # many half-lives long
    ],
)
def test_decayed_is_the_integral_of_the_decayed_rate(
    rate: float, start: float, end: float, now: float, half_life: float
) -> None:
    assert decayed(rate, start, end, now, half_life) == pytest.approx(
        numeric(rate, start, end, now, half_life), rel=1e-8
    )


@pytest.mark.parametrize(("start", "end", "rate"), [(10.0, 10.0, 1.0), (10.0, 5.0, 1.0), (0.0, 10.0, 0.0)])
def test_decayed_is_zero_for_an_empty_interval_or_no_rate(start: float, end: float, rate: float) -> None:
    assert decayed(rate, start, end, 100.0, 60.0) == 0.0


def test_decayed_recent_usage_counts_about_its_resource_seconds() -> None:
    # a minute's use just now, with a day's half-life: almost exactly rate * 60
    assert decayed(4.0, 0.0, 60.0, 60.0, 86_400.0) == pytest.approx(240.0, rel=1e-3)


times = st.floats(min_value=0.0, max_value=1e6, allow_nan=False)
rates = st.floats(min_value=0.0, max_value=1e3, allow_nan=False)
half_lives = st.floats(min_value=60.0, max_value=1e6, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(rate=rates, a=times, b=times, c=times, later=times, half_life=half_lives)
def test_decayed_is_additive_over_split_intervals(
    rate: float, a: float, b: float, c: float, later: float, half_life: float
) -> None:
    start, mid, end = sorted((a, b, c))
    now = end + later
    whole = decayed(rate, start, end, now, half_life)
    tol = 1e-9 * rate * half_life + 1e-12  # each term is rate * tau * (difference of exponentials)
    assert decayed(rate, start, mid, now, half_life) + decayed(rate, mid, end, now, half_life) == pytest.approx(
        whole, abs=tol
    )


@settings(max_examples=300, deadline=None)
@given(rate=rates, a=times, b=times, later=times, half_life=half_lives)
def test_decayed_halves_after_one_half_life(rate: float, a: float, b: float, later: float, half_life: float) -> None:
    start, end = sorted((a, b))
    now = end + later
    then = decayed(rate, start, end, now, half_life)
    assert decayed(rate, start, end, now + half_life, half_life) == pytest.approx(
        then / 2, rel=1e-9, abs=1e-9 * rate * half_life + 1e-12
    )


def test_usage_of_counts_running_attempts_up_to_now_weighted_by_resource() -> None:
    config = FairShare(half_life_seconds=HOUR)  # CPU 1, GPU 10
    now = 10 * HOUR
    uses = [
        Use("alice", "ml", {"CPU": 2.0}, start=now - HOUR, end=None),  # running: counts to now
        Use("alice", "ml", {"CPU": 1.0, "GPU": 1.0}, start=now - 3 * HOUR, end=now - 2 * HOUR),  # rate 11
        Use("bob", "ml", {"CPU": 4.0}, start=now - HOUR, end=now + HOUR),  # an end past now is cut at now
        Use("carol", None, {"GPU": 2.0}, start=now - 2 * HOUR, end=now - HOUR),  # rate 20
        Use("dave", None, {"CPU": 1.0}, start=now + 1, end=None),  # not started yet: nothing
    ]
    usage = usage_of(uses, now, config)
    tau = HOUR / math.log(2)
    alice = 2 * tau * (1 - 0.5) + 11 * tau * (0.25 - 0.125)
    bob = 4 * tau * (1 - 0.5)
    carol = 20 * tau * (0.5 - 0.25)
    assert usage.owners == pytest.approx({"alice": alice, "bob": bob, "carol": carol, "dave": 0.0}, rel=1e-12)
    assert usage.teams == pytest.approx({"ml": alice + bob, "~carol": carol, "~dave": 0.0}, rel=1e-12)


@pytest.mark.parametrize(
    ("held", "rate"),
    [
        ({"CPU": 2.0, "GPU": 4.0}, 2 + 4 * 10),  # untyped GPUs: the GPU weight
        ({"CPU": 2.0, "GPU": 4.0, "accelerator_type:H100": 0.004}, 2 + 4 * 30),  # GPU:H100 set
        ({"CPU": 2.0, "GPU": 4.0, "accelerator_type:T4": 0.0}, 2 + 4 * 1),  # as standing reads an attempt's type
        ({"CPU": 2.0, "GPU": 4.0, "accelerator_type:A100": 0.004}, 2 + 4 * 10),  # no weight of its own: GPU's
        ({"CPU": 2.0, "accelerator_type:H100": 0.002}, 2),  # a CPU node type with a type: no GPUs to weigh
    ],
)
def test_gpu_seconds_weigh_by_accelerator_type_where_a_weight_is_set(held: dict[str, float], rate: float) -> None:
    """Issue 37: `resource_weights` may weigh each accelerator type's GPUs (`"GPU:H100": 30`), so an hour on an
    H100 costs an owner's fair share more than an hour on a T4; a type without a weight counts as `GPU`."""
    config = FairShare.parse({"resource_weights": {"GPU:H100": 30, "GPU:T4": 1}})
    assert config.rate(held) == pytest.approx(rate)
    # Alice trained an hour on 4 H100s, bob an hour on 4 T4s: bob's usage is far below hers, so he goes first.
    uses = [Use("alice", None, {"GPU": 4.0, "accelerator_type:H100": 0.0}, start=0.0, end=HOUR),
            Use("bob", None, {"GPU": 4.0, "accelerator_type:T4": 0.0}, start=0.0, end=HOUR)]  # fmt: skip
    usage = usage_of(uses, HOUR, config)
    assert usage.owners["alice"] == pytest.approx(30 * usage.owners["bob"])


def test_a_running_attempt_is_usage_already() -> None:
    """One running job and three waiting puts its owner behind one with nothing running (issue 15 part 2)."""
    config = FairShare(half_life_seconds=HOUR)
    usage = usage_of([Use("alice", None, {"CPU": 2.0}, start=0.0)], 600.0, config)
    waiting = [cand(f"a{i}", "alice", seq=i) for i in range(3)] + [cand("b0", "bob", seq=10.0)]
    assert ids(fair_order(waiting, usage, config))[0] == "b0"


def test_shares_are_each_owners_fraction_of_all_usage() -> None:
    config = FairShare(owner_weights={"bob": 3.0})
    got = shares(Usage(owners={"alice": 30.0, "bob": 10.0}), config)
    assert got == {
        "alice": {"usage": 30.0, "share": 0.75, "weight": 1.0},
        "bob": {"usage": 10.0, "share": 0.25, "weight": 3.0},
    }
    assert shares(Usage(owners={"alice": 0.0}), config)["alice"]["share"] == 0.0


# ---- fair order -------------------------------------------------------------------------------------------------

P = 100.0  # projection of a 1-CPU job in these tables: 1 CPU x projection_seconds
FS = FairShare(projection_seconds=P)


@pytest.mark.parametrize(
    ("waiting", "usage", "config", "expected"),
    [
        pytest.param(  # priority dominates usage
            [cand("b0", "bob", seq=0), cand("a0", "alice", prio=5, seq=9)],
            Usage({"~alice": 1e9}, {"alice": 1e9}), FS, ["a0", "b0"], id="priority-dominates",
        ),
        pytest.param(  # FIFO within an owner, whatever the input order
            [cand("a3", seq=3), cand("a1", seq=1), cand("a2", seq=2)], Usage(), FS, ["a1", "a2", "a3"], id="fifo",
        ),
        pytest.param(  # team first (ml has less usage), then owner within the team (c1 before the older c2)
            [cand("m1a", "m1", "ml", seq=1), cand("m1b", "m1", "ml", seq=2), cand("c1", "c1", "cv", seq=3),
             cand("c2", "c2", "cv", seq=0)],
            Usage({"ml": 100.0, "cv": 500.0}, {"m1": 100.0, "c1": 0.0, "c2": 500.0}), FS,
            ["m1a", "m1b", "c1", "c2"], id="team-then-owner",
        ),
        pytest.param(  # equal owners alternate: each placed job counts as projected usage
            [cand(f"a{i}", "alice", seq=i) for i in range(4)] + [cand(f"b{i}", "bob", seq=10 + i) for i in range(4)],
            Usage(), FS, ["a0", "b0", "a1", "b1", "a2", "b2", "a3", "b3"], id="equal-owners-alternate",
        ),
        pytest.param(  # bob used 3.5 projections less: he gets the next four places, not all of them
            [cand(f"a{i}", "alice", seq=i) for i in range(5)] + [cand(f"b{i}", "bob", seq=10 + i) for i in range(7)],
            Usage({"~alice": 3.5 * P}, {"alice": 3.5 * P}), FS,
            ["b0", "b1", "b2", "b3", "a0", "b4", "a1", "b5", "a2", "b6", "a3", "a4"], id="less-usage-not-all",
        ),
        pytest.param(  # a bigger job projects more: one 4-CPU job of alice's equals four of bob's 1-CPU jobs
            [cand("a0", "alice", seq=0, cpu=4), cand("a1", "alice", seq=1, cpu=4)]
            + [cand(f"b{i}", "bob", seq=10 + i) for i in range(5)],
            Usage(), FS, ["a0", "b0", "b1", "b2", "b3", "a1", "b4"], id="projection-by-size",
        ),
        pytest.param(  # GPUs weigh 10 CPUs by default
            [cand("a0", "alice", seq=0, gpu=1, cpu=0), cand("a1", "alice", seq=1, gpu=1, cpu=0)]
            + [cand(f"b{i}", "bob", seq=10 + i) for i in range(11)],
            Usage(), FS, ["a0"] + [f"b{i}" for i in range(10)] + ["a1", "b10"], id="gpu-weight",
        ),
        pytest.param(  # projection carries across priority levels
            [cand("a0", "alice", prio=1, seq=5), cand("a1", "alice", seq=0), cand("b0", "bob", seq=1)],
            Usage(), FS, ["a0", "b0", "a1"], id="projection-across-priorities",
        ),
        pytest.param(  # fair share off: priority then FIFO, usage ignored
            [cand("a1", "alice", seq=1), cand("b0", "bob", seq=2), cand("a0", "alice", seq=0),
             cand("c0", "carol", prio=1, seq=3)],
            Usage({"~alice": 1e9}, {"alice": 1e9}), FairShare(enabled=False), ["c0", "a0", "a1", "b0"], id="disabled",
        ),
        pytest.param(  # at equal usage the team whose oldest job is older goes first, not the smaller name
            [cand("a0", "ann", "aa", seq=2), cand("z0", "zed", "zz", seq=1)], Usage(), FS, ["z0", "a0"],
            id="team-tie-fifo",
        ),
        pytest.param(  # nor do owners without a team ("" sorts first) jump ahead of an older team job
            [cand("n0", "nat", None, seq=2), cand("m0", "max", "ml", seq=1)], Usage(), FS, ["m0", "n0"],
            id="teamless-tie-fifo",
        ),
    ],
)  # fmt: skip
def test_fair_order(waiting: list[Candidate], usage: Usage, config: FairShare, expected: list[str]) -> None:
    before = (dict(usage.teams), dict(usage.owners))
    assert ids(fair_order(waiting, usage, config)) == expected
    assert (usage.teams, usage.owners) == before  # the projection is the order's own, not the caller's


@pytest.mark.parametrize("weights", [{"owner_weights": {"alice": 2.0}}, {"team_weights": {"red": 2.0}}])
def test_weight_two_gets_twice_the_places(weights: dict[str, dict[str, float]]) -> None:
    config = FairShare(projection_seconds=P, **weights)  # type: ignore[arg-type]
    team = "red" if "team_weights" in weights else None
    other = "blue" if team else None
    waiting = [cand(f"a{i}", "alice", team, seq=i) for i in range(100)]
    waiting += [cand(f"b{i}", "bob", other, seq=i + 0.5) for i in range(100)]
    order = ids(fair_order(waiting, Usage(), config))
    for n in (30, 60, 90):
        alice = sum(1 for job_id in order[:n] if job_id.startswith("a"))
        assert alice == 2 * n // 3, (n, order[:n])


def test_weight_scales_past_usage() -> None:
    """alice has twice bob's usage and twice his weight: they are even, and alternate."""
    config = FairShare(projection_seconds=P, owner_weights={"alice": 2.0})
    usage = Usage({"~alice": 2000.0, "~bob": 1000.0}, {"alice": 2000.0, "bob": 1000.0})
    waiting = [cand(f"a{i}", "alice", seq=i) for i in range(3)] + [cand(f"b{i}", "bob", seq=10 + i) for i in range(3)]
    assert ids(fair_order(waiting, usage, config))[:3] == ["a0", "b0", "a1"]


@pytest.mark.parametrize(
    ("running", "expected"),
    [
        pytest.param([], ["a1", "b0", "a2"], id="none-running-fifo-at-equal-usage"),
        # alice's job has just started (usage still ~0): it will go on holding its CPUs, so bob goes first
        pytest.param([("alice", None, {"CPU": 1.0})], ["b0", "a1", "a2"], id="a-running-job-counts"),
        # four of bob's running CPUs outweigh alice's one: alice's two go first
        pytest.param([("alice", None, {"CPU": 1.0}), ("bob", "red", {"CPU": 4.0})], ["a1", "a2", "b0"],
                     id="bigger-holder-waits"),
        # the team level counts it too: bob's teammate holds the team's share
        pytest.param([("carl", "red", {"CPU": 2.0})], ["a1", "a2", "b0"], id="team-level"),
    ],
)  # fmt: skip
def test_fair_order_counts_what_admitted_jobs_hold(
    running: list[tuple[str, str | None, dict[str, float]]], expected: list[str]
) -> None:
    waiting = [cand("a1", "alice", seq=1), cand("a2", "alice", seq=2), cand("b0", "bob", "red", seq=1.5)]
    if running and running[0][0] == "carl":
        waiting = [cand("a1", "alice", "blue", seq=1), cand("a2", "alice", "blue", seq=2), waiting[2]]
    assert ids(fair_order(waiting, Usage(), FS, running)) == expected


@pytest.mark.parametrize(
    ("a1_seconds", "expected"),
    [
        # unbounded, a1 counts a whole projection (P) like b0: alice and bob tie, and FIFO puts bob's older b1 first
        pytest.param(None, ["a1", "b0", "b1", "a2"], id="unbounded-counts-the-projection"),
        pytest.param(2 * P, ["a1", "b0", "b1", "a2"], id="timeout-longer-than-the-projection"),
        # a1 can run P/10 at most: alice has used less than bob after one job each, so her a2 goes before b1
        pytest.param(P / 10, ["a1", "b0", "a2", "b1"], id="timeout-bounds-the-projection"),
    ],
)  # fmt: skip
def test_a_placed_job_counts_no_longer_than_its_timeout(a1_seconds: float | None, expected: list[str]) -> None:
    """Jobs of minutes each counted as a whole projection (an hour by default) made the order equalise what owners
    hold now, not what they use: the heaviest owner got 0.82-0.91 of its share in 100-job simulations."""
    a1 = replace(cand("a1", "alice", seq=1), run_seconds=a1_seconds)
    waiting = [a1, cand("b0", "bob", seq=2), cand("b1", "bob", seq=3), cand("a2", "alice", seq=4)]
    assert ids(fair_order(waiting, Usage(), FS)) == expected


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [
        pytest.param(None, ["b0", "a1"], id="unbounded-running-job-ties-fifo"),
        pytest.param(P / 10, ["a1", "b0"], id="running-job-near-its-timeout-counts-less"),
        pytest.param(-5.0, ["a1", "b0"], id="past-its-timeout-counts-nothing-more"),
    ],
)  # fmt: skip
def test_a_running_job_counts_no_longer_than_its_timeout(seconds: float | None, expected: list[str]) -> None:
    waiting = [cand("a1", "alice", seq=2), cand("b0", "bob", seq=1)]
    running = [Holding("alice", None, {"CPU": 1.0}, seconds), Holding("bob", None, {"CPU": 1.0})]
    assert ids(fair_order(waiting, Usage(), FS, running)) == expected


# ---- settings parsers: each error names the key -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({}, FairShare()),
        ({"enabled": False}, FairShare(enabled=False)),
        ({"half_life_hours": 2}, FairShare(half_life_seconds=7200.0)),
        ({"projection_seconds": 60}, FairShare(projection_seconds=60.0)),
        ({"resource_weights": {"GPU": 4}}, FairShare(resource_weights={"CPU": 1.0, "GPU": 4.0})),
        ({"resource_weights": {"TPU": 8}}, FairShare(resource_weights={"CPU": 1.0, "GPU": 10.0, "TPU": 8.0})),
        ({"owner_weights": {"alice": 2}, "team_weights": {"ml": 0}},
         FairShare(owner_weights={"alice": 2.0}, team_weights={"ml": 0.0})),
    ],
)  # fmt: skip
def test_fair_share_parse(value: dict[str, object], expected: FairShare) -> None:
    assert FairShare.parse(value) == expected


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ({"half_life": 1}, "fair_share: unknown keys ['half_life']"),
        ({"enabled": "yes"}, "fair_share.enabled"),
        ({"half_life_hours": 0}, "fair_share.half_life_hours"),
        ({"half_life_hours": -1}, "fair_share.half_life_hours"),
        ({"half_life_hours": True}, "fair_share.half_life_hours"),
        ({"half_life_hours": "24"}, "fair_share.half_life_hours"),
        ({"projection_seconds": 0}, "fair_share.projection_seconds"),
        ({"resource_weights": {"GPU": -1}}, "fair_share.resource_weights"),
        ({"resource_weights": ["GPU"]}, "fair_share.resource_weights"),
        ({"team_weights": {"ml": "2"}}, "fair_share.team_weights"),
        ({"owner_weights": {"alice": True}}, "fair_share.owner_weights"),
    ],
)
def test_fair_share_parse_errors_name_the_key(value: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError) as err:
        FairShare.parse(value)
    assert str(err.value).startswith(named), str(err.value)


def test_quotas_parse() -> None:
    rules = Quotas.parse({"owner": {"*": {"max_running": 2}, "alice": {"max_gpus": 4, "max_gpu_hours": 10,
                                                                       "window_hours": 24}},
                          "team": {"ml": {"max_cpus": 16, "window_hours": None}}})  # fmt: skip
    assert rules.of_owner("bob") == Quota(max_running=2)
    assert rules.of_owner("alice") == Quota(max_gpus=4, max_gpu_hours=10, window_hours=24)  # replaces '*'
    assert rules.of_team("ml") == Quota(max_cpus=16)  # window_hours null: the default week
    assert rules.of_team("cv") is None
    assert rules.of_team(None) is None
    assert Quotas.parse({"team": {"*": {"max_gpus": 1}}}).of_team(None) is None  # no team, no team quota
    assert Quotas.parse({}) == Quotas()
    typed = Quotas.parse({"owner": {"alice": {"max_gpus_by_type": {"H100": 8, "T4": None}}}}).of_owner("alice")
    assert typed == Quota(max_gpus_by_type={"H100": 8})  # a null cap is no cap
    assert Quota.parse(typed.as_dict(), "stored") == typed  # as a queue's JSON column keeps it, and reads it back


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ({"owners": {}}, "quotas: unknown keys ['owners']"),
        ({"owner": ["alice"]}, "quotas.owner: "),
        ({"owner": {"alice": 3}}, "quotas.owner.alice: "),
        ({"owner": {"alice": {"max_jobs": 3}}}, "quotas.owner.alice: unknown keys ['max_jobs']"),
        ({"owner": {"*": {"max_running": -1}}}, "quotas.owner.*.max_running: "),
        ({"team": {"ml": {"max_gpus": "8"}}}, "quotas.team.ml.max_gpus: "),
        ({"team": {"ml": {"max_cpus": True}}}, "quotas.team.ml.max_cpus: "),
        ({"team": {"ml": {"window_hours": 0}}}, "quotas.team.ml.window_hours: "),
        ({"team": {"ml": {"max_gpus_by_type": 8}}}, "quotas.team.ml.max_gpus_by_type: "),
        ({"team": {"ml": {"max_gpus_by_type": {"H100": -1}}}}, "quotas.team.ml.max_gpus_by_type.H100: "),
        ({"team": {"ml": {"max_gpus_by_type": {"H100": "8"}}}}, "quotas.team.ml.max_gpus_by_type.H100: "),
    ],
)
def test_quotas_parse_errors_name_the_key(value: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError) as err:
        Quotas.parse(value)
    assert str(err.value).startswith(named), str(err.value)


def test_parse_queue_limit() -> None:
    limit = parse_queue_limit(
        {"max_running": 3, "max_cpus": 8, "max_gpus": 2, "preemption": True, "cohort": "lab",
         "borrowing_limit": {"cpus": 4}, "owner_quota": {"max_running": 1}, "team_quota": {"max_gpus": 1}},
        "queues.q",
    )  # fmt: skip
    assert limit == QueueLimit(3, 8, 2, True, Quota(max_running=1), Quota(max_gpus=1), "lab", {"cpus": 4})
    assert limit.nominal("CPU") == 8 and limit.nominal("GPU") == 2 and limit.nominal("memory") is None
    assert parse_queue_limit({}, "queues.q") == QueueLimit()


@pytest.mark.parametrize(
    ("conf", "named"),
    [
        (["max_running"], "queues.q: "),
        ({"max_jobs": 1}, "queues.q: unknown keys ['max_jobs']"),
        ({"owner_quota": {"max_jobs": 1}}, "queues.q.owner_quota: unknown keys ['max_jobs']"),
        ({"team_quota": {"max_gpus": -2}}, "queues.q.team_quota.max_gpus: "),
        ({"borrowing_limit": {"memory": 1}}, "queues.q.borrowing_limit: "),
        ({"borrowing_limit": 4}, "queues.q.borrowing_limit: "),
        ({"borrowing_limit": {"cpus": "4"}}, "queues.q.borrowing_limit.cpus: "),
        ({"borrowing_limit": {"gpus": -1}}, "queues.q.borrowing_limit.gpus: "),
        ({"max_cpus": "8"}, "queues.q.max_cpus: "),
        ({"max_running": -1}, "queues.q.max_running: "),
        ({"max_gpus": True}, "queues.q.max_gpus: "),
        ({"preemption": "yes"}, "queues.q.preemption: "),
        ({"cohort": 3}, "queues.q.cohort: "),
    ],
)
def test_parse_queue_limit_errors_name_the_key(conf: object, named: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_queue_limit(conf, "queues.q")  # type: ignore[arg-type]
    assert str(err.value).startswith(named), str(err.value)


# ---- quotas.check: every scope, with the limit and the current use in the reason --------------------------------

Job_ = tuple[str, str, "str | None", dict[str, float]]  # (queue, owner, team, total) of an admitted job


def hold(*jobs: Job_) -> dict[Scope, Held]:
    out: dict[Scope, Held] = {}
    for queue, owner, team, total in jobs:
        quotas.count(out, total, queue, owner, team)
    return out


def cpus(n: float) -> dict[str, float]:
    return {"CPU": float(n)}


def gpus(n: float) -> dict[str, float]:
    return {"CPU": 1.0, "GPU": float(n)}


def typed(kind: str, n: float) -> dict[str, float]:
    """A job of n GPUs asking for one accelerator type (`resources.accelerator_type`: 0.001 of it per GPU worker)."""
    return {"CPU": 1.0, "GPU": float(n), f"accelerator_type:{kind}": 0.001 * n}


OWNER_STAR = Quotas(owners={"*": Quota(max_running=1, max_gpus=1), "bob": Quota(max_running=3)})
H100_CAPS = Quotas(teams={"ml": Quota(max_gpus_by_type={"H100": 8, "T4": 0})})
IN_Q_H100 = {"q": QueueLimit(owner_quota=Quota(max_gpus_by_type={"H100": 2}))}
TEAM_ML = Quotas(teams={"ml": Quota(max_gpus=8)})
TEAM_STAR = Quotas(teams={"*": Quota(max_running=1)})
IN_Q = {"q": QueueLimit(owner_quota=Quota(max_running=1), team_quota=Quota(max_cpus=2))}
QCAPS = {"q": QueueLimit(max_running=2, max_cpus=4, max_gpus=2)}


@pytest.mark.parametrize(
    ("total", "who", "limits", "rules", "running", "reason"),
    [
        # cluster-wide owner quotas: '*' for everyone, a named entry replaces it (not merged)
        (cpus(1), ("q", "alice", None), {}, OWNER_STAR, [], None),
        (cpus(1), ("q", "alice", None), {}, OWNER_STAR, [("other", "alice", None, cpus(1))],
         "owner 'alice' is at its limit of 1 running jobs"),
        (gpus(2), ("q", "alice", None), {}, OWNER_STAR, [], "owner 'alice' would exceed its 1 GPUs (0 in use)"),
        (cpus(1), ("q", "bob", None), {}, OWNER_STAR, [("q", "bob", None, cpus(1))] * 2, None),
        (gpus(4), ("q", "bob", None), {}, OWNER_STAR, [], None),  # bob's entry has no GPU cap
        (cpus(1), ("q", "bob", None), {}, OWNER_STAR, [("q", "bob", None, cpus(1))] * 3,
         "owner 'bob' is at its limit of 3 running jobs"),
        (cpus(1), ("q", "carol", None), {}, OWNER_STAR, [("q", "alice", None, cpus(1))], None),  # per owner
        (cpus(3), ("q", "alice", None), {}, Quotas(owners={"alice": Quota(max_cpus=4)}),
         [("q", "alice", None, cpus(2))], "owner 'alice' would exceed its 4 CPUs (2 in use)"),
        # cluster-wide team quotas: every member's jobs count
        (gpus(2), ("q", "alice", "ml"), {}, TEAM_ML, [("x", "bob", "ml", gpus(6))], None),
        (gpus(3), ("q", "alice", "ml"), {}, TEAM_ML, [("x", "bob", "ml", gpus(6))],
         "team 'ml' would exceed its 8 GPUs (6 in use)"),
        (gpus(3), ("q", "alice", "cv"), {}, TEAM_ML, [("x", "bob", "ml", gpus(6))], None),  # another team
        (cpus(1), ("q", "alice", "cv"), {}, TEAM_STAR, [("x", "bob", "cv", cpus(1))],
         "team 'cv' is at its limit of 1 running jobs"),
        (cpus(1), ("q", "alice", None), {}, TEAM_STAR, [("x", "bob", None, cpus(1))], None),  # no team: no quota
        # per owner / per team within a queue: only that queue's jobs count
        (cpus(1), ("q", "alice", None), IN_Q, Quotas(), [("other", "alice", None, cpus(1))], None),
        (cpus(1), ("q", "alice", None), IN_Q, Quotas(), [("q", "alice", None, cpus(1))],
         "owner 'alice' in queue 'q' is at its limit of 1 running jobs"),
        (cpus(1), ("q", "bob", None), IN_Q, Quotas(), [("q", "alice", None, cpus(1))], None),
        (cpus(1), ("q", "bob", "ml"), IN_Q, Quotas(), [("q", "alice", "ml", cpus(2))],
         "team 'ml' in queue 'q' would exceed its 2 CPUs (2 in use)"),
        (cpus(1), ("q", "bob", "ml"), IN_Q, Quotas(), [("other", "alice", "ml", cpus(2))], None),
        # the queue's own caps count everyone's jobs in it
        (cpus(1), ("q", "alice", None), QCAPS, Quotas(), [("q", "bob", None, cpus(1))], None),
        (cpus(1), ("q", "alice", None), QCAPS, Quotas(), [("q", "bob", None, cpus(1))] * 2,
         "queue 'q' is at its limit of 2 running jobs"),
        (cpus(2), ("q", "alice", None), QCAPS, Quotas(), [("q", "bob", None, cpus(3))],
         "queue 'q' would exceed its 4 CPUs (3 in use)"),
        (gpus(2), ("q", "alice", None), QCAPS, Quotas(), [("q", "bob", None, gpus(1))],
         "queue 'q' would exceed its 2 GPUs (1 in use)"),
        (gpus(2), ("other", "alice", None), QCAPS, Quotas(), [("q", "bob", None, gpus(2))] * 2, None),
        # GPUs of one accelerator type (issue 37): only jobs asking for that type count, and only against its cap
        (typed("H100", 2), ("q", "alice", "ml"), {}, H100_CAPS, [("x", "bob", "ml", typed("H100", 6))], None),
        (typed("H100", 3), ("q", "alice", "ml"), {}, H100_CAPS, [("x", "bob", "ml", typed("H100", 6))],
         "team 'ml' would exceed its 8 H100 GPUs (6 in use)"),
        (typed("H100", 3), ("q", "alice", "ml"), {}, H100_CAPS, [("x", "bob", "ml", typed("A100", 6)),
         ("x", "bob", "ml", gpus(4))], None),  # other types' GPUs and untyped GPUs are not H100s
        (typed("A100", 16), ("q", "alice", "ml"), {}, H100_CAPS, [("x", "bob", "ml", typed("H100", 8))], None),
        (typed("T4", 1), ("q", "alice", "ml"), {}, H100_CAPS, [], "team 'ml' would exceed its 0 T4 GPUs (0 in use)"),
        (typed("T4", 1), ("q", "alice", "cv"), {}, H100_CAPS, [], None),  # another team
        (typed("H100", 2), ("q", "alice", None), IN_Q_H100, Quotas(), [("other", "alice", None, typed("H100", 8))],
         None),  # a quota within queue q counts q's jobs only
        (typed("H100", 1), ("q", "alice", None), IN_Q_H100, Quotas(), [("q", "alice", None, typed("H100", 2))],
         "owner 'alice' in queue 'q' would exceed its 2 H100 GPUs (2 in use)"),
    ],
)  # fmt: skip
def test_quota_check(
    total: dict[str, float], who: tuple[str, str, str | None], limits: dict[str, QueueLimit], rules: Quotas,
    running: list[Job_], reason: str | None,
) -> None:  # fmt: skip
    queue, owner, team = who
    assert check(total, queue, owner, team, limits=limits, quotas=rules, held=hold(*running)) == reason


GPU_HOURS_OWNER = Quotas(owners={"*": Quota(max_gpu_hours=10, window_hours=24)})


@pytest.mark.parametrize(
    ("total", "who", "limits", "rules", "used", "reason"),
    [
        (gpus(1), ("q", "alice", None), {}, GPU_HOURS_OWNER, {("owner", "alice"): 9.5}, None),
        (gpus(1), ("q", "alice", None), {}, GPU_HOURS_OWNER, {("owner", "alice"): 10.0},
         "owner 'alice' has used 10.0 of its 10 GPU-hours in the last 24 h"),
        (gpus(1), ("q", "alice", None), {}, GPU_HOURS_OWNER, {("owner", "bob"): 50.0}, None),  # bob's hours
        (cpus(4), ("q", "alice", None), {}, GPU_HOURS_OWNER, {("owner", "alice"): 50.0}, None),  # CPU-only job
        (gpus(1), ("q", "alice", "ml"), {}, Quotas(teams={"ml": Quota(max_gpu_hours=100)}),
         {("team", "ml"): 123.4}, "team 'ml' has used 123.4 of its 100 GPU-hours in the last 168 h"),
        (gpus(1), ("q", "alice", None), {"q": QueueLimit(owner_quota=Quota(max_gpu_hours=2, window_hours=1))},
         Quotas(), {("queue-owner", "q", "alice"): 2.0},
         "owner 'alice' in queue 'q' has used 2.0 of its 2 GPU-hours in the last 1 h"),
        (gpus(1), ("q", "alice", "ml"), {"q": QueueLimit(team_quota=Quota(max_gpu_hours=5))},
         Quotas(), {("queue-team", "q", "ml"): 7.25},
         "team 'ml' in queue 'q' has used 7.2 of its 5 GPU-hours in the last 168 h"),
        (gpus(1), ("q", "alice", "ml"), {"q": QueueLimit(team_quota=Quota(max_gpu_hours=5))},
         Quotas(), {("team", "ml"): 7.25}, None),  # the team's hours outside this quota's scope
    ],
)  # fmt: skip
def test_gpu_hours_quota(
    total: dict[str, float], who: tuple[str, str, str | None], limits: dict[str, QueueLimit], rules: Quotas,
    used: dict[Scope, float], reason: str | None,
) -> None:  # fmt: skip
    queue, owner, team = who
    assert check(total, queue, owner, team, limits=limits, quotas=rules, held={}, gpu_hours=used) == reason


def cohort(a: dict[str, object] | None = None, b: dict[str, object] | None = None) -> dict[str, QueueLimit]:
    """Queues a and b, 4 CPUs nominal each, in cohort 'lab'; `solo` (4 CPUs) in none."""
    return {
        "a": QueueLimit(max_cpus=4, cohort="lab", **(a or {})),  # type: ignore[arg-type]
        "b": QueueLimit(max_cpus=4, cohort="lab", **(b or {})),  # type: ignore[arg-type]
        "solo": QueueLimit(max_cpus=4),
        "default": QueueLimit(),
    }


@pytest.mark.parametrize(
    ("need", "queue", "limits", "running", "reason"),
    [
        (2, "a", cohort(), [("a", "x", None, cpus(2)), ("b", "y", None, cpus(4))], None),  # within nominal
        (2, "a", cohort(), [("a", "x", None, cpus(4))], None),  # borrows b's idle 4
        (4, "a", cohort(), [("a", "x", None, cpus(4))], None),  # all of it
        (5, "a", cohort(), [("a", "x", None, cpus(4))],
         "queue 'a' would exceed its 4 CPUs (4 in use) and cohort 'lab' has 4 idle CPUs to lend"),
        (2, "a", cohort(), [("a", "x", None, cpus(4)), ("b", "y", None, cpus(3))],
         "queue 'a' would exceed its 4 CPUs (4 in use) and cohort 'lab' has 1 idle CPUs to lend"),
        (2, "a", cohort(), [("a", "x", None, cpus(4)), ("b", "y", None, cpus(4))],
         "queue 'a' would exceed its 4 CPUs (4 in use) and cohort 'lab' has 0 idle CPUs to lend"),
        (2, "a", cohort(), [("a", "x", None, cpus(3)), ("b", "y", None, cpus(4))],  # 1 of its own left: not enough
         "queue 'a' would exceed its 4 CPUs (3 in use) and cohort 'lab' has 1 idle CPUs to lend"),
        (2, "a", cohort({"borrowing_limit": {"cpus": 2}}), [("a", "x", None, cpus(4))], None),  # up to its limit
        (3, "a", cohort({"borrowing_limit": {"cpus": 2}}), [("a", "x", None, cpus(4))],
         "queue 'a' would exceed its 4 CPUs (4 in use) and may borrow at most 2 from cohort 'lab'"),
        (1, "a", cohort({"borrowing_limit": {"cpus": 0}}), [("a", "x", None, cpus(4))],
         "queue 'a' would exceed its 4 CPUs (4 in use) and may borrow at most 0 from cohort 'lab'"),
        (2, "a", cohort({"borrowing_limit": {"gpus": 0}}), [("a", "x", None, cpus(4))], None),  # CPUs unlimited
        (1, "b", cohort(), [("b", "y", None, cpus(4)), ("a", "x", None, cpus(2)), ("a", "z", None, cpus(2))],
         "queue 'b' would exceed its 4 CPUs (4 in use) and cohort 'lab' has 0 idle CPUs to lend"),
        (1, "solo", cohort(), [("solo", "x", None, cpus(4))], "queue 'solo' would exceed its 4 CPUs (4 in use)"),
        (9, "default", cohort(), [("a", "x", None, cpus(8))], None),  # no cap, no cohort
    ],
)  # fmt: skip
def test_cohort_borrowing(
    need: float, queue: str, limits: dict[str, QueueLimit], running: list[Job_], reason: str | None
) -> None:
    assert check(cpus(need), queue, "owner", None, limits=limits, quotas=Quotas(), held=hold(*running)) == reason


def test_cohort_helpers() -> None:
    limits = cohort()
    held = hold(("a", "x", None, cpus(6)), ("b", "y", None, cpus(1)))
    assert quotas.cohort_idle("lab", "CPU", limits, held) == 1.0
    # Neither member caps GPUs: none is in the cohort's GPU pool, so there is nothing to lend (a queue with no cap
    # needs no loan; one with a cap may not borrow another's uncapped resource).
    assert quotas.cohort_idle("lab", "GPU", limits, held) == 0.0
    assert quotas.borrowed("a", "CPU", limits, held) == 2.0
    assert quotas.borrowed("b", "CPU", limits, held) == 0.0
    assert quotas.borrowed("default", "CPU", limits, held) == 0.0
    assert quotas.borrowed("unknown", "CPU", limits, held) == 0.0


# ---- plan: what it admits counts, in the same pass, against every scope -----------------------------------------


@pytest.mark.parametrize(
    ("waiting", "free", "limits", "rules", "running", "admitted", "reason"),
    [
        ([cand(f"a{i}", seq=i) for i in range(5)], nodes(16), {}, Quotas(owners={"*": Quota(max_running=2)}), [],
         ["a0", "a1"], "owner 'alice' is at its limit of 2 running jobs"),
        ([cand(f"a{i}", seq=i) for i in range(5)], nodes(16), {}, Quotas(owners={"*": Quota(max_running=2)}),
         [("other", "alice", None, cpus(1))], ["a0"], "owner 'alice' is at its limit of 2 running jobs"),
        ([cand(f"a{i}", seq=i, cpu=2) for i in range(5)], nodes(16), {}, Quotas(owners={"*": Quota(max_cpus=5)}),
         [], ["a0", "a1"], "owner 'alice' would exceed its 5 CPUs (4 in use)"),
        ([cand(f"{o}{i}", o, "ml", seq=i) for o in ("x", "y") for i in range(3)], nodes(16), {},
         Quotas(teams={"ml": Quota(max_cpus=3)}), [], ["x0", "y0", "x1"],
         "team 'ml' would exceed its 3 CPUs (3 in use)"),
        ([cand(f"a{i}", seq=i, gpu=2, cpu=0, queue="q") for i in range(4)], nodes(0, 16),
         {"q": QueueLimit(max_gpus=4)}, Quotas(), [], ["a0", "a1"], "queue 'q' would exceed its 4 GPUs (4 in use)"),
        ([cand(f"a{i}", seq=i, queue="q") for i in range(4)], nodes(16), {"q": QueueLimit(max_running=3)}, Quotas(),
         [("q", "bob", None, cpus(1))], ["a0", "a1"], "queue 'q' is at its limit of 3 running jobs"),
        ([cand(f"{o}{i}", o, seq=i, queue="q") for o in ("x", "y") for i in range(3)], nodes(16),
         {"q": QueueLimit(owner_quota=Quota(max_running=1))}, Quotas(), [], ["x0", "y0"],
         "owner 'y' in queue 'q' is at its limit of 1 running jobs"),
        ([cand(f"a{i}", seq=i, queue="a") for i in range(7)], nodes(16), cohort(), Quotas(),
         [("b", "y", None, cpus(1))], ["a0", "a1", "a2", "a3", "a4", "a5", "a6"], None),
        ([cand(f"a{i}", seq=i, queue="a") for i in range(8)], nodes(16), cohort(), Quotas(),
         [("b", "y", None, cpus(1))], ["a0", "a1", "a2", "a3", "a4", "a5", "a6"],
         "queue 'a' would exceed its 4 CPUs (7 in use) and cohort 'lab' has 0 idle CPUs to lend"),
        ([cand(f"a{i}", seq=i, queue="a") for i in range(8)], nodes(16), cohort({"borrowing_limit": {"cpus": 1}}),
         Quotas(), [], ["a0", "a1", "a2", "a3", "a4"],
         "queue 'a' would exceed its 4 CPUs (5 in use) and may borrow at most 1 from cohort 'lab'"),
    ],
)  # fmt: skip
def test_plan_counts_what_it_admits(
    waiting: list[Candidate], free: list[NodeFree], limits: dict[str, QueueLimit], rules: Quotas,
    running: list[Job_], admitted: list[str], reason: str | None,
) -> None:  # fmt: skip
    held = hold(*running)
    result = plan(waiting, free, limits=limits, rules=rules, held=held)
    assert result.admit == admitted
    rest = [c.job_id for c in waiting if c.job_id not in admitted]
    assert set(result.waiting) == set(rest)
    if rest:
        assert result.waiting[rest[-1]] == reason
    assert held == hold(*running)  # the caller's numbers are not changed


def test_plan_follows_the_fair_order_and_quota_skips_do_not_stop_the_rest() -> None:
    waiting = [cand(f"a{i}", "alice", seq=i) for i in range(3)] + [cand(f"b{i}", "bob", seq=10 + i) for i in range(3)]
    rules = Quotas(owners={"alice": Quota(max_running=1)})
    ordered = fair_order(waiting, Usage(), FS)
    result = plan(waiting, nodes(4), rules=rules, ordered=ordered)
    assert result.admit == ["a0", "b0", "b1", "b2"]
    assert result.waiting == {f"a{i}": "owner 'alice' is at its limit of 1 running jobs" for i in (1, 2)}


# ---- reclaim: a lender takes back its lent quota ---------------------------------------------------------------


def run(job_id: str, queue: str, cpu: float, seq: float, prio: int = 0, yielding: bool = False) -> Running:
    return Running(job_id, prio, seq, cpus(cpu), yielding, queue)


def reclaimed(
    waiting: list[Candidate], running: list[Running], free: float, limits: dict[str, QueueLimit]
) -> tuple[Plan, tuple[Candidate, list[str]] | None]:
    """Plan on one node with `free` CPUs (and a GPU), then reclaim with the running jobs' holdings; the first job
    served, with its victims (None: none served)."""
    result, served = reclaimed_all(waiting, running, free, limits)
    return result, served[0] if served else None


def reclaimed_all(
    waiting: list[Candidate], running: list[Running], free: float, limits: dict[str, QueueLimit]
) -> tuple[Plan, list[tuple[Candidate, list[str]]]]:
    held = hold(*[(r.queue, "someone", None, r.total) for r in running])
    result = plan(waiting, [NodeFree("n0", {"CPU": free, "GPU": 1.0})], limits=limits, held=held)
    return result, reclaim(result, waiting, running, {"CPU": free, "GPU": 1.0}, limits=limits, held=held)


# b borrows 2 of a's 4 CPUs: b1, b2, b3 hold 2 CPUs each (b's nominal is 4)
B6 = [run("b1", "b", 2, seq=1), run("b2", "b", 2, seq=2), run("b3", "b", 2, seq=3)]


@pytest.mark.parametrize(
    ("waiting", "running", "free", "limits", "victims"),
    [
        ([cand("l", queue="a", cpu=2)], B6, 0, cohort(), ["b3"]),  # the newest borrower, and only it
        ([cand("l", queue="a", cpu=4)], B6, 2, cohort(), ["b3"]),  # free room and b3's make 4
        ([cand("l", queue="a", cpu=4)], B6, 0, cohort(), None),  # b2 is within b's nominal quota: never
        ([cand("l", queue="a", cpu=1)], B6, 1, cohort(), None),  # not waiting: admitted
        ([cand("l", queue="a", cpu=2)], [*B6, run("a1", "a", 3, seq=9)], 0, cohort(), None),  # 3+2 > a's 4
        ([cand("l", queue="a", cpu=2)], [*B6, run("new", "default", 2, seq=9)], 0, cohort(), ["b3"]),  # not in it
        ([cand("l", queue="a", cpu=2)], [*B6, run("a1", "a", 2, seq=9)], 0, cohort(), ["b3"]),  # not its own queue
        ([cand("l", queue="a", cpu=2)], [run("b1", "b", 2, seq=1, prio=9), run("b2", "b", 2, seq=2),
                                         run("b3", "b", 2, seq=3, prio=9)], 0, cohort(), ["b3"]),  # priority: no shield
        ([cand("l", queue="a", cpu=2)], [*B6[:2], run("b3", "b", 2, seq=3, yielding=True)], 0, cohort(), None),
        ([cand("l", queue="solo", cpu=2)], [run("s", "solo", 2, seq=1), *B6], 0, cohort(), None),  # no cohort
        ([cand("l", queue="default", cpu=2)], B6, 0, cohort(), None),  # no nominal quota to take back
        ([cand("l", queue="a", cpu=2, gpu=1)], B6, 0, cohort(), ["b3"]),  # GPUs uncapped: CPUs are reclaimed
    ],
)  # fmt: skip
def test_reclaim(
    waiting: list[Candidate], running: list[Running], free: float, limits: dict[str, QueueLimit],
    victims: list[str] | None,
) -> None:  # fmt: skip
    _, chosen = reclaimed(waiting, running, free, limits)
    assert (chosen[1] if chosen else None) == victims
    assert chosen is None or chosen[0] is waiting[0]


def test_reclaim_only_from_queues_over_their_nominal_quota() -> None:
    """Three queues in a cohort: x holds the newest job but within its quota, so b (borrowing) yields instead."""
    limits = {
        "a": QueueLimit(max_cpus=4, cohort="lab"),
        "b": QueueLimit(max_cpus=2, cohort="lab"),
        "x": QueueLimit(max_cpus=4, cohort="lab"),
    }
    running = [run("b1", "b", 2, seq=1), run("b2", "b", 2, seq=2), run("x1", "x", 2, seq=9)]
    _, chosen = reclaimed([cand("l", queue="a", cpu=2)], running, 0, limits)
    assert chosen is not None and chosen[1] == ["b2"]


def test_reclaim_takes_as_many_borrowers_as_needed_newest_first() -> None:
    running = [run(f"b{i}", "b", 1, seq=i) for i in range(8)]  # b holds 8: borrows all of a's 4
    _, chosen = reclaimed([cand("l", queue="a", cpu=3)], running, 0, cohort())
    assert chosen is not None and chosen[1] == ["b7", "b6", "b5"]


def test_reclaim_serves_every_lender_job_it_can_in_one_pass() -> None:
    """b borrows all of a's 4 CPUs with four 1-CPU jobs; a's three 1-CPU jobs and one 2-CPU job wait. One pass asks
    b's jobs to yield for the first three (newest first, one each) and stops at the 2-CPU one: a's nominal 4 would
    be exceeded (3 + 2), so it is not a lender's job any more."""
    running = [run(f"b{i}", "b", 1, seq=i) for i in range(8)]
    waiting = [cand(f"l{i}", queue="a", seq=10 + i) for i in range(3)] + [cand("l3", queue="a", cpu=2, seq=20)]
    _, served = reclaimed_all(waiting, running, 0, cohort())
    assert [(c.job_id, victims) for c, victims in served] == [("l0", ["b7"]), ("l1", ["b6"]), ("l2", ["b5"])]


def test_reclaim_counts_free_room_once_across_lenders() -> None:
    """One free CPU serves the first lender alone; the second needs a victim."""
    running = [run(f"b{i}", "b", 1, seq=i) for i in range(7)]
    waiting = [cand("l0", queue="a", seq=10), cand("l1", queue="a", seq=11)]
    result = plan(waiting, [NodeFree("n0", {"CPU": 1.0})], limits=cohort(),
                  held=hold(*[(r.queue, "someone", None, r.total) for r in running]))  # fmt: skip
    # b holds 7 of the cohort's 8 with a at 0: the cohort has 1 idle, which plan gives to l0; l1 waits
    assert result.admit == ["l0"]
    held = hold(*[(r.queue, "someone", None, r.total) for r in running], ("a", "someone", None, cpus(1)))
    served = reclaim(result, waiting, running, {"CPU": 0.0}, limits=cohort(), held=held)
    assert [(c.job_id, victims) for c, victims in served] == [("l1", ["b6"])]


def test_reclaim_serves_the_first_lender_waiting() -> None:
    """The first lender in admission order is served; one behind it is not served ahead of it."""
    waiting = [cand("big", queue="a", cpu=4, seq=1), cand("small", queue="a", cpu=1, seq=2)]
    running = [run("b1", "b", 4, seq=1), run("b2", "b", 1, seq=2)]  # b borrows 1; freeing it cannot fit `big`
    result, chosen = reclaimed(waiting, running, 0, cohort())
    assert set(result.waiting) == {"big", "small"}
    assert chosen is None


def test_preemption_waits_while_one_is_in_flight_and_needs_a_preempting_queue() -> None:
    blocked = cand("urgent", prio=5, cpu=2, queue="r")
    low = [run("low", "r", 2, seq=1)]
    on = {"r": QueueLimit(preemption=True)}
    result = plan([blocked], nodes(0), limits=on)
    assert preemption(result, [blocked], low, {"CPU": 0.0}, limits=on) == (blocked, ["low"])
    assert preemption(result, [blocked], low, {"CPU": 0.0}, limits={"r": QueueLimit()}) is None
    in_flight = [*low, run("other", "default", 1, seq=2, yielding=True)]
    assert preemption(result, [blocked], in_flight, {"CPU": 0.0}, limits=on) is None
    quota_wait = plan([blocked], nodes(8), limits=on, rules=Quotas(owners={"*": Quota(max_running=0)}))
    assert preemption(quota_wait, [blocked], low, {"CPU": 0.0}, limits=on) is None  # waits for quota, not room


# ---- standing: what admission reads from the database, on SQLite and PostgreSQL ---------------------------------

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)


def add_attempts(
    engine: Engine, rows: list[tuple[str, str | None, str, float, float, float, float | None]], kind: str | None = None
) -> None:
    """rows: (owner, team, queue, cpus, gpus, started hours ago, ended hours ago or None: running); `kind`: the jobs'
    accelerator type."""
    with Session(engine) as session:
        for i, (owner, team, queue, cpu, gpu, started, ended) in enumerate(rows):
            job = Job(name=f"j{i}", spec={"entrypoint": {"callable": "a:b"}}, owner=owner, team=team, queue=queue,
                      state=JobState.RUNNING if ended is None else JobState.SUCCEEDED, attempt=1,
                      accelerator_type=kind)  # fmt: skip
            session.add(job)
            session.flush()
            session.add(Attempt(job_id=job.id, number=1, submission_id=f"{job.id}-1", cpus=cpu, gpus=gpu,
                                started_at=NOW - timedelta(hours=started),
                                ended_at=None if ended is None else NOW - timedelta(hours=ended)))  # fmt: skip
        session.commit()


def test_fair_usage_from_attempts(db: Engine) -> None:
    add_attempts(
        db,
        [
            ("alice", "ml", "q", 2.0, 0.0, 1.0, None),  # running for an hour: 2 CPUs
            ("alice", "ml", "q", 1.0, 1.0, 3.0, 2.0),  # rate 11, ended two half-lives ago
            ("bob", "ml", "default", 4.0, 0.0, 2.0, 1.0),
            ("carol", None, "q", 0.0, 2.0, 30.0, 25.0),  # ended 25 h ago: past the horizon, not read
            ("dave", None, "q", 8.0, 0.0, 9.0, 8.0),  # ended 8 h ago: inside the horizon of 10 half-lives
        ],
    )
    config = FairShare(half_life_seconds=HOUR)  # horizon: 10 h
    with Session(db) as session:
        usage = standing.fair_usage(session, config, NOW)
        assert standing.fair_usage(session, FairShare(enabled=False), NOW) == Usage()
    tau = HOUR / math.log(2)
    alice = 2 * tau * (1 - 2**-1) + 11 * tau * (2**-2 - 2**-3)
    bob = 4 * tau * (2**-1 - 2**-2)
    dave = 8 * tau * (2**-8 - 2**-9)
    assert usage.owners == pytest.approx({"alice": alice, "bob": bob, "dave": dave}, rel=1e-9)
    assert usage.teams == pytest.approx({"ml": alice + bob, "~dave": dave}, rel=1e-9)


def test_fair_usage_weighs_gpus_by_the_jobs_accelerator_type(db: Engine) -> None:
    """The type each job asked for (jobs.accelerator_type) reaches fair share's weights from the database."""
    add_attempts(db, [("alice", None, "q", 0.0, 4.0, 2.0, 1.0)], kind="H100")
    add_attempts(db, [("bob", None, "q", 0.0, 4.0, 2.0, 1.0)], kind="T4")
    config = FairShare.parse({"half_life_hours": 1, "resource_weights": {"GPU:H100": 30, "GPU:T4": 1}})
    with Session(db) as session:
        usage = standing.fair_usage(session, config, NOW, cached=False)
    assert usage.owners["alice"] == pytest.approx(30 * usage.owners["bob"], rel=1e-9) and usage.owners["bob"] > 0


def test_gpu_hours_per_quota_window(db: Engine) -> None:
    add_attempts(
        db,
        [
            ("alice", "ml", "q", 1.0, 2.0, 3.0, 0.0),  # 6 GPU-hours, all in every window
            ("alice", "ml", "q", 1.0, 1.0, 30.0, 20.0),  # 4 of its 10 in the 24 h window, all 10 in 48 h
            ("alice", "ml", "other", 1.0, 4.0, 2.0, None),  # running: 8 so far
            ("bob", "ml", "q", 1.0, 1.0, 0.5, None),  # 0.5
            ("bob", None, "q", 8.0, 0.0, 5.0, 1.0),  # no GPUs: nothing
            ("carol", None, "q", 1.0, 1.0, 100.0, 60.0),  # before every window
        ],
    )
    rules = Quotas(
        owners={"*": Quota(max_gpu_hours=100, window_hours=24)},
        teams={"ml": Quota(max_gpu_hours=100, window_hours=48), "cv": Quota(max_gpus=1)},
    )
    limits = {"q": QueueLimit(owner_quota=Quota(max_gpu_hours=10, window_hours=1), team_quota=Quota(max_running=1))}
    with Session(db) as session:
        got = standing.gpu_hours(session, rules, limits, NOW)
        assert standing.gpu_hours(session, Quotas(owners={"*": Quota(max_gpus=1)}), {}, NOW) == {}
    assert got == pytest.approx(
        {
            ("owner", "alice"): 6 + 4 + 8,
            ("owner", "bob"): 0.5,
            ("team", "ml"): 6 + 10 + 8 + 0.5,
            ("queue-owner", "q", "alice"): 2.0,  # the last hour of the first attempt
            ("queue-owner", "q", "bob"): 0.5,
        },
        rel=1e-9,
    )


def test_admission_reclaims_in_a_pass_that_also_admits(db: Engine) -> None:
    """Queue b (4 CPUs nominal, cohort lab) runs three 2-CPU jobs: it borrows 2 of a's. A 2-CPU job of a waits for
    room; a 1-CPU job of `default` fits in the one free CPU. The pass admits the small job and asks b's newest to
    yield for a's."""
    from service.config.settings import Settings
    from service.core.backend import ClusterView, NodeView
    from service.dispatch import admission
    from service.spec.job import JobSpec
    from service.store.db import session_scope

    def spec(workers: int) -> dict[str, object]:
        return {"entrypoint": {"callable": "a:b"}, "resources": {"num_workers": workers}}

    with session_scope(db) as session:
        for i in range(3):
            session.add(Job(name=f"b{i}", spec=spec(2), queue="b", owner="bob", state=JobState.RUNNING, attempt=1,
                            created_at=NOW - timedelta(hours=3 - i)))  # fmt: skip
        session.add(Job(name="lender", spec=spec(2), queue="a", owner="alice", created_at=NOW - timedelta(seconds=60)))
        session.add(Job(name="small", spec=spec(1), owner="carol", created_at=NOW - timedelta(seconds=30)))
    config = Settings(queues={"a": {"max_cpus": 4, "cohort": "lab"}, "b": {"max_cpus": 4, "cohort": "lab"}})
    cluster = ClusterView([NodeView("n0", "127.0.0.1", True, {"CPU": 7.0}, {"CPU": 1.0})])
    started, victims = admission.admit(
        db, config, cluster, owner="test", now=NOW,
        spec_of=lambda job: (JobSpec.model_validate(job.spec), None),
        resources_of=lambda job: JobSpec.model_validate(job.spec).resources.total(),
    )  # fmt: skip
    assert [j.name for j in started] == ["small"]
    assert [j.name for j in victims] == ["b2"]


def test_a_member_without_a_cap_lends_none_of_that_resource() -> None:
    """a caps CPUs at 4, b caps only GPUs: b is not in the cohort's CPU pool, so a cannot borrow CPUs through it."""
    limits = {"a": QueueLimit(max_cpus=4, cohort="lab"), "b": QueueLimit(max_gpus=2, cohort="lab")}
    held = hold(("a", "x", None, cpus(4)))
    why = quotas.check(cpus(96), "a", "x", None, limits=limits, quotas=Quotas(), held=held)
    assert why == "queue 'a' would exceed its 4 CPUs (4 in use) and cohort 'lab' has 0 idle CPUs to lend"


def test_owners_without_a_team_share_as_owners_not_as_one_team() -> None:
    """Five owners without a team and one owner of team ml, equal usage: each of the six gets every sixth place (they
    do not share one team's turn between the five)."""
    waiting = [cand(f"{o}{i}", o, None, seq=i + k / 10) for k, o in enumerate("abcde") for i in range(6)]
    waiting += [cand(f"m{i}", "m", "ml", seq=i + 0.9) for i in range(6)]
    first = ids(fair_order(waiting, Usage(), FairShare(projection_seconds=P)))[:12]
    assert sum(1 for job_id in first if job_id.startswith("m")) == 2, first


def test_fair_usage_is_reread_after_refresh_seconds(db: Engine) -> None:
    """Each process reuses the settled usage it read for `refresh_seconds` of the service's clock (decaying it to each
    call's now), then reads the attempts again."""
    config = FairShare(half_life_seconds=HOUR, refresh_seconds=30.0)
    add_attempts(db, [("alice", None, "q", 1.0, 0.0, 2.0, 1.0)])
    with Session(db) as session:
        first = standing.fair_usage(session, config, NOW)
    add_attempts(db, [("bob", None, "q", 1.0, 0.0, 2.0, 1.0)])
    with Session(db) as session:
        kept = standing.fair_usage(session, config, NOW + timedelta(seconds=10)).owners  # bob's settled end unread
        assert kept == pytest.approx({"alice": first.owners["alice"] * 2 ** (-10 / HOUR)}, rel=1e-9)  # decayed to now
        fresh = standing.fair_usage(session, config, NOW + timedelta(seconds=31))
        assert set(fresh.owners) == {"alice", "bob"}
        assert set(standing.fair_usage(session, config, NOW + timedelta(seconds=31), cached=False).owners) == {
            "alice", "bob"}  # fmt: skip


def test_an_attempt_that_ends_or_starts_after_a_read_counts_at_the_next_call(db: Engine) -> None:
    """Only settled usage (attempts ended over `SETTLED_MARGIN` before the read) is reused: an attempt running at the
    read that ends a few seconds later, and one that starts after it, count at the very next call, as a fresh read
    counts them. (A job that ended on its driver's word 15 s after it started left its owner at near-zero usage for
    the rest of the 30 s, and that owner's next job went ahead of an owner who had used nothing.)"""
    config = FairShare(half_life_seconds=HOUR, refresh_seconds=30.0)
    add_attempts(db, [("alice", None, "q", 4.0, 0.0, 1 / 360, None), ("dave", None, "q", 1.0, 0.0, 2.0, 1.0)])
    with Session(db) as session:
        first = standing.fair_usage(session, config, NOW)
        assert first.owners["alice"] == pytest.approx(4.0 * 10, rel=0.01)  # 10 s of 4 CPUs so far
        attempt = session.exec(select(Attempt).where(col(Attempt.ended_at).is_(None))).one()
        attempt.ended_at = NOW + timedelta(seconds=5)
        session.add(attempt)
        session.commit()
    add_attempts(db, [("bob", None, "q", 2.0, 0.0, -8 / 3600, None)])  # started 8 s after the read
    later = NOW + timedelta(seconds=12)
    with Session(db) as session:
        kept = standing.fair_usage(session, config, later)
        fresh = standing.fair_usage(session, config, later, cached=False)
    assert kept.owners == pytest.approx(fresh.owners, rel=1e-9)
    assert kept.teams == pytest.approx(fresh.teams, rel=1e-9)
    assert kept.owners["alice"] == pytest.approx(4.0 * 15, rel=0.01)  # all 15 s it ran, not the 10 s of the read
    assert kept.owners["bob"] == pytest.approx(2.0 * 4, rel=0.01)
    assert kept.owners["dave"] == pytest.approx(first.owners["dave"] * 2 ** (-12 / HOUR), rel=1e-9)
