"""Elastic worker groups (issue 16, part 1, admission): `resources.num_workers: {min, max}` starts at the most workers
in the range that fit the free room and every quota and limit (gang semantics for min), holds what it was admitted
with, and says its size (`world_size`). Pure policy tables, then one admission pass on a real database."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from service.policy.quotas import QueueLimit, Quota, Quotas
from service.policy.scheduler import WAITING_FOR_ROOM, Candidate, NodeFree, Running, place, plan, preemption, sized
from service.spec.job import JobSpec

NOW = datetime(2026, 12, 1, 12, tzinfo=timezone.utc)


def cand(job_id: str, workers: int, least: int | None = None, *, cpu: float = 1.0, seq: float = 0.0,
         placement: str = "pack", prio: int = 0, owner: str = "alice") -> Candidate:  # fmt: skip
    return Candidate(job_id, prio, seq, workers, {"CPU": cpu}, placement, "default", owner, None, None, least)


def nodes(*cpus: float) -> list[NodeFree]:
    return [NodeFree(f"n{i}", {"CPU": c}) for i, c in enumerate(cpus)]


@pytest.mark.parametrize(
    ("job", "free", "size", "waits"),
    [
        pytest.param(cand("e", 8, 2), (5,), 5, None, id="takes-what-fits-of-its-range"),
        pytest.param(cand("e", 8, 2), (16,), 8, None, id="never-more-than-max"),
        pytest.param(cand("e", 8, 2), (3, 2), 5, None, id="across-nodes"),
        pytest.param(cand("e", 8, 2), (1,), None, f"{WAITING_FOR_ROOM} for 2 x", id="min-does-not-fit-waits"),
        pytest.param(cand("e", 8, 2, placement="strict_spread"), (4, 4, 4), 3, None, id="strict-spread-one-a-node"),
        pytest.param(cand("e", 8, 2, placement="strict_pack"), (3, 6), 6, None, id="strict-pack-on-the-larger"),
        pytest.param(cand("e", 8, 3, cpu=2.0), (5, 3), 3, None, id="whole-workers-per-node"),
        pytest.param(cand("r", 4), (3,), None, f"{WAITING_FOR_ROOM} for 4 x", id="rigid-group-is-all-or-nothing"),
        pytest.param(cand("r", 4, 4), (8,), 4, None, id="min-equal-max-is-rigid"),
    ],
)  # fmt: skip
def test_an_elastic_group_starts_at_the_most_that_fits(
    job: Candidate, free: tuple[float, ...], size: int | None, waits: str | None
) -> None:
    result = plan([job], nodes(*free))
    if size is None:
        assert result.admit == [] and result.waiting[job.job_id].startswith(waits or "")
    else:
        assert result.admit == [job.job_id] and result.sizes[job.job_id] == size


def test_quotas_bound_the_size_not_only_the_start() -> None:
    """alice may hold 3 CPUs: her elastic job starts at 3 of its 2..8 on an idle 8-CPU node (not refused, not 8)."""
    rules = Quotas(owners={"alice": Quota(max_cpus=3)})
    result = plan([cand("e", 8, 2)], nodes(8), rules=rules)
    assert result.sizes == {"e": 3}
    over = plan([cand("e", 8, 4)], nodes(8), rules=rules)
    assert over.admit == [] and "alice" in over.waiting["e"]


def test_a_queue_limit_bounds_the_size() -> None:
    result = plan([cand("e", 8, 1)], nodes(8), limits={"default": QueueLimit(max_cpus=2)})
    assert result.sizes == {"e": 2}


def test_jobs_behind_get_the_room_an_elastic_job_leaves() -> None:
    """The elastic job ahead takes the most that fits; the next one starts in what is left, never in room it took."""
    result = plan([cand("e", 6, 2, seq=1), cand("r", 2, seq=2)], nodes(7))
    assert result.admit == ["e"] and result.sizes["e"] == 6
    result = plan([cand("r", 2, seq=1), cand("e", 6, 2, seq=2)], nodes(7))
    assert result.admit == ["r", "e"] and result.sizes == {"r": 2, "e": 5}


def test_preemption_frees_room_for_an_elastic_jobs_min_only() -> None:
    """A high-priority elastic job of 2..8 that cannot start asks for room for 2, not 8: one victim, not all."""
    blocked = cand("hi", 8, 2, prio=10)
    result = plan([blocked], nodes(0))
    running = [Running(f"low{i}", 0, float(i), {"CPU": 2.0}) for i in range(4)]
    chosen = preemption(result, [blocked], running, {"CPU": 0.0}, limits={"default": QueueLimit(preemption=True)})
    assert chosen is not None and chosen[1] == ["low3"]


@given(
    least=st.integers(1, 12), extra=st.integers(0, 12), free=st.lists(st.integers(0, 6), min_size=1, max_size=5),
    per=st.sampled_from([1.0, 2.0]), placement=st.sampled_from(["pack", "spread", "strict_pack", "strict_spread"]),
)  # fmt: skip
def test_bisection_finds_the_largest_size_that_places(
    least: int, extra: int, free: list[int], per: float, placement: str
) -> None:
    job = cand("e", least + extra, least, cpu=per, placement=placement)
    room = nodes(*free)
    got, placed, reason = sized(job, room, lambda total: None)
    fitting = [n for n in range(least, least + extra + 1) if place(cand("x", n, cpu=per, placement=placement), room)]
    assert reason is None
    if not fitting:
        assert placed is None and got.num_workers == least
    else:
        assert placed is not None and got.num_workers == max(fitting) and len(placed) == got.num_workers


# ---- the spec ---------------------------------------------------------------------------------------------------
def spec(num_workers: Any, **strategy: Any) -> JobSpec:
    body: dict[str, Any] = {"entrypoint": {"callable": "a:b"}, "resources": {"num_workers": num_workers}}
    if strategy:
        body["strategy"] = strategy
    return JobSpec.model_validate(body)


def test_the_range_reads_back_as_written() -> None:
    elastic = spec({"min": 2, "max": 6})
    assert (elastic.resources.min_workers, elastic.resources.max_workers, elastic.resources.elastic) == (2, 6, True)
    assert elastic.model_dump(mode="json")["resources"]["num_workers"] == {"min": 2, "max": 6}
    assert spec(3).model_dump(mode="json")["resources"]["num_workers"] == 3
    assert elastic.resources.total(4) == {"CPU": 4.0} and elastic.resources.total(99) == {"CPU": 6.0}


@pytest.mark.parametrize(
    ("num_workers", "strategy", "field", "words"),
    [
        ({"min": 3, "max": 1}, {}, "resources.num_workers.max", "at least min (3)"),
        ({"min": 0, "max": 2}, {}, "resources.num_workers.min", "greater than or equal to 1"),
        ({"min": 1}, {}, "resources.num_workers.max", "required"),
        ({"min": 1, "max": 2, "step": 1}, {}, "resources.num_workers.step", "Extra"),
        ({"min": 1, "max": 5000}, {}, "resources.num_workers.max", "less than or equal to 4096"),
        (True, {}, "resources.num_workers", "an integer number of workers"),
        ("4", {}, "resources.num_workers", "an integer number of workers"),
        # every size of the range must suit the strategy: a train_batch_size fixed for one size fails at others
        ({"min": 1, "max": 2}, {"kind": "deepspeed", "deepspeed": {"config": {"train_batch_size": 8,
         "train_micro_batch_size_per_gpu": 4}}}, "strategy.deepspeed.config.train_batch_size", "8 != micro batch"),
    ],
)  # fmt: skip
def test_a_bad_range_is_refused_naming_the_field(num_workers: Any, strategy: dict, field: str, words: str) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as caught:
        spec(num_workers, **strategy)
    errors = caught.value.errors()
    assert len(errors) == 1, errors
    where = ".".join(str(p) for p in errors[0]["loc"])
    # The strategy's own checks name their field in the message (the API answers 422 with it either way).
    assert (where.startswith(field) or field in errors[0]["msg"]) and words in errors[0]["msg"], errors


# ---- one admission pass on a real database --------------------------------------------------------------------
def test_admission_records_the_size_and_holds_what_it_admitted(db: Engine) -> None:
    from service.config.settings import Settings
    from service.core.backend import ClusterView, NodeView
    from service.dispatch import admission
    from service.dispatch.submission import build
    from service.store.models import Attempt, Job

    specs = {"elastic": {"min": 2, "max": 8}, "after": 2}
    with Session(db) as session:
        for i, (name, workers) in enumerate(specs.items()):
            session.add(Job(name=name, spec={"entrypoint": {"callable": "a:b"}, "resources": {"num_workers": workers}},
                            owner="alice", created_at=NOW.replace(second=i)))  # fmt: skip
        session.commit()
    cluster = ClusterView([NodeView("n0", "127.0.0.1", True, {"CPU": 7.0}, {"CPU": 7.0})])
    settings = Settings()
    started, _ = admission.admit(
        db, settings, cluster, owner="test", now=NOW,
        spec_of=lambda job: (JobSpec.model_validate(job.spec), None),
        resources_of=lambda job: JobSpec.model_validate(job.spec).resources.total(job.world_size),
    )  # fmt: skip
    assert [j.name for j in started] == ["elastic"]  # 7 free: it takes 7; the rigid 2 behind it waits
    with Session(db) as session:
        job = session.exec(select(Job).where(Job.name == "elastic")).one()
        attempt = session.exec(select(Attempt).where(Attempt.job_id == job.id)).one()
        assert job.world_size == 7 and attempt.cpus == 7.0
        from service.store.models import JobEvent

        said = [
            e.message for e in session.exec(select(JobEvent).where(JobEvent.job_id == job.id)) if e.reason == "admitted"
        ]
        assert said == ["at 7 workers of 2 to 8"]
        sub = build(session, job, JobSpec.model_validate(job.spec), settings)
        assert sub.runtime_env["env_vars"]["SHUNTER_WORLD_SIZE"] == "7"
    # What it holds counts against the next pass: 7 of 7 CPUs, so nothing else starts.
    again, _ = admission.admit(
        db, settings, ClusterView([NodeView("n0", "127.0.0.1", True, {"CPU": 7.0}, {"CPU": 0.0})]), owner="test",
        now=NOW, spec_of=lambda job: (JobSpec.model_validate(job.spec), None),
        resources_of=lambda job: JobSpec.model_validate(job.spec).resources.total(job.world_size),
    )  # fmt: skip
    assert again == []
