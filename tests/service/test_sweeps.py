"""Sweeps and arrays (issue 18): expansion of grid / points / count and its 422s, the max_parallel hold and the ranking
(pure tables); then on a real database (SQLite and PostgreSQL): a sweep and its members are one transaction, the
request reads back as sent, admission never has more than max_parallel members active and held members block no job
behind them, the best member is read from the metrics the jobs reported, and a cancel reaches every live member."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from service.config.settings import Settings
from service.core.errors import Conflict, InvalidSpec
from service.lifecycle import sweeps
from service.lifecycle.state import transition
from service.policy import sweep_rules
from service.policy.sweep_rules import Queued, Scored
from service.spec.job import JobSpec
from service.spec.sweep import SPEC_ROOTS, SweepRequest, member_specs
from service.store.models import EndReason, Job, JobState, Metric, Sweep
from service.tenancy.auth import Caller
from tests.service.test_spec_roundtrip import json_values, spec_bodies

BASE: dict[str, Any] = {"entrypoint": {"callable": "examples.mlp:train_loop"}, "config": {"total_steps": 4}}
NOW = datetime(2026, 12, 2, 9, 0, tzinfo=timezone.utc)
ALICE = Caller(owner="alice", admin=False)


def req(**body: Any) -> SweepRequest:
    return SweepRequest.model_validate({"base": BASE, **body})


# ---- expansion ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"grid": {"lr": [1, 2]}}, [{"lr": 1}, {"lr": 2}]),
        # the last key varies fastest
        ({"grid": {"lr": [1, 2], "hidden": [8, 16]}},
         [{"lr": 1, "hidden": 8}, {"lr": 1, "hidden": 16}, {"lr": 2, "hidden": 8}, {"lr": 2, "hidden": 16}]),
        ({"points": [{"lr": 1, "hidden": 8}, {"lr": 3}]}, [{"lr": 1, "hidden": 8}, {"lr": 3}]),
        # grid x points, grid-major
        ({"grid": {"seed": [0, 1]}, "points": [{"lr": 1}, {"lr": 2}]},
         [{"seed": 0, "lr": 1}, {"seed": 0, "lr": 2}, {"seed": 1, "lr": 1}, {"seed": 1, "lr": 2}]),
        ({"count": 3}, [{"config.sweep_index": 0}, {"config.sweep_index": 1}, {"config.sweep_index": 2}]),
        # count repeats each combination, repetitions adjacent, sweep_index the member's own index
        ({"grid": {"lr": [1, 2]}, "count": 2},
         [{"lr": 1, "config.sweep_index": 0}, {"lr": 1, "config.sweep_index": 1},
          {"lr": 2, "config.sweep_index": 2}, {"lr": 2, "config.sweep_index": 3}]),
        ({"points": [{}]}, [{}]),  # an empty point: the base as it is
        ({"grid": {"resources.num_workers": [1, 2]}}, [{"resources.num_workers": 1}, {"resources.num_workers": 2}]),
    ],
)  # fmt: skip
def test_assignments(body: dict[str, Any], expected: list[dict[str, Any]]) -> None:
    request = req(**body)
    assert list(request.assignments()) == expected
    assert request.size == len(expected)


def test_member_specs_fill_in_config_and_spec_paths_and_name_members() -> None:
    grid = {"lr": [0.1], "optim.beta": [0.9], "config.queue": ["q"], "resources.num_workers": [2], "priority": [5]}
    [(values, spec)] = member_specs(req(name="mlp", grid=grid, count=1))
    assert values == {"lr": 0.1, "optim.beta": 0.9, "config.queue": "q", "resources.num_workers": 2, "priority": 5,
                      "config.sweep_index": 0}  # fmt: skip
    assert spec.name == "mlp-0"
    assert spec.config == {"total_steps": 4, "lr": 0.1, "optim": {"beta": 0.9}, "queue": "q", "sweep_index": 0}
    assert (spec.resources.num_workers, spec.priority, spec.queue) == (2, 5, "default")
    assert SweepRequest.model_validate({"base": {**BASE, "name": "pre"}, "count": 1}).name == "pre"  # from base


def test_size_is_computed_without_expanding() -> None:
    request = req(grid={f"k{i}": list(range(10)) for i in range(12)})  # 10^12 members
    assert request.size == 10**12


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "grid"),  # none of grid, points, count
        ({"grid": {}}, "grid"),
        ({"grid": {"lr": []}}, "grid.lr"),
        ({"grid": {"lr": 0.1}}, "grid.lr"),  # not a list
        ({"points": []}, "points"),
        ({"points": [3]}, "points"),
        ({"grid": {"name": [1]}}, "grid.name"),  # names are the sweep's (config.name is a config key)
        ({"grid": {"name.x": [1]}}, "grid.name.x"),
        ({"points": [{"notify": []}]}, "points.notify"),  # write-only secrets: set in base, never swept
        ({"grid": {"lr": [1], "optim": [{}], "optim.lr": [2]}}, "grid.optim.lr"),  # config.optim, then inside it
        ({"grid": {"config..lr": [1]}}, "grid.config..lr"),
        ({"grid": {"lr": [1], "config.lr": [2]}}, "grid.config.lr"),  # one value set twice
        ({"grid": {"config.optim": [{}], "config.optim.lr": [2]}}, "grid.config.optim.lr"),
        ({"grid": {"lr": [1]}, "points": [{"lr": 2}]}, "points.lr"),
        ({"grid": {"sweep_index": [1]}, "count": 2}, "grid.sweep_index"),
        ({"count": 0}, "count"),
        ({"count": 2, "max_parallel": 0}, "max_parallel"),
        ({"count": 2, "metric": {"name": "loss", "mode": "lowest"}}, "metric.mode"),
        ({"count": 2, "metric": {"name": "a b"}}, "metric.name"),
        ({"count": 2, "name": "-x"}, "name"),
        ({"count": 2, "name": "x" * 121}, "name"),
        ({"count": 2, "colour": "red"}, "colour"),
        ({"count": 2, "base": {"entrypoint": {"callable": "nope"}}}, "base.entrypoint.callable"),
    ],
)  # fmt: skip
def test_bad_requests_name_the_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        SweepRequest.model_validate({"base": BASE, **body})
    first = info.value.errors()[0]
    named = ".".join(str(p) for p in first["loc"] if not isinstance(p, int) and "[" not in str(p))
    assert named == field, info.value


def test_nan_in_a_grid_is_refused() -> None:
    with pytest.raises(ValidationError, match="finite"):
        req(grid={"lr": [float("nan")]})


@pytest.mark.parametrize(
    ("body", "field", "said"),
    [
        ({"grid": {"resources.num_workers": [1, 0]}}, "grid.resources.num_workers", "member 1"),
        ({"points": [{"strategy.kind": "zero"}]}, "points.strategy.kind", "member 0"),
        ({"grid": {"resources.bogus": [1]}}, "grid.resources.bogus", "member 0"),
        ({"grid": {"config.total_steps.x": [1]}}, "grid.config.total_steps.x", "not a mapping"),
        ({"grid": {"lr": [1]}, "base": {**BASE, "resources": {"num_workers": 0}}}, "base", ""),  # base itself
    ],
)  # fmt: skip
def test_a_bad_member_names_its_member_and_key(body: dict[str, Any], field: str, said: str) -> None:
    try:
        member_specs(SweepRequest.model_validate({"base": BASE, **body}))
    except InvalidSpec as exc:
        assert exc.field == field and said in exc.detail, (exc.field, exc.detail)
    except ValidationError as exc:  # the base is checked as the request is parsed
        assert field == "base" and exc.errors()[0]["loc"][0] == "base"
    else:
        raise AssertionError("accepted")


# ---- max_parallel and ranking: pure tables ---------------------------------------------------------------------
def q(job: str, sweep: str, index: int) -> Queued:
    return Queued(job, sweep, index)


@pytest.mark.parametrize(
    ("queued", "active", "limits", "held"),
    [
        ([], {}, {}, {}),
        ([q("a", "s", 0), q("b", "s", 1)], {}, {}, {}),  # no limit: nothing held
        ([q("a", "s", 0), q("b", "s", 1), q("c", "s", 2)], {}, {"s": 1}, {"b": "free", "c": "free"}),
        ([q("c", "s", 2), q("b", "s", 1), q("a", "s", 0)], {}, {"s": 1}, {"b": "free", "c": "free"}),  # by index
        ([q("a", "s", 0), q("b", "s", 1)], {"s": 1}, {"s": 1}, {"a": "full", "b": "full"}),
        ([q("a", "s", 0), q("b", "s", 1), q("c", "s", 2)], {"s": 1}, {"s": 2}, {"b": "free", "c": "free"}),
        ([q("a", "s", 0), q("b", "s", 1), q("c", "s", 2)], {}, {"s": 2}, {"c": "free"}),
        ([q("a", "s", 0)], {"s": 3}, {"s": 2}, {"a": "full"}),  # over the limit (it was lowered? never: still held)
        ([q("a", "s", 0), q("b", "t", 0), q("c", "t", 1)], {"t": 0}, {"t": 1}, {"c": "free"}),  # s has no limit
    ],
)  # fmt: skip
def test_hold(queued: list[Queued], active: dict[str, int], limits: dict[str, int], held: dict[str, str]) -> None:
    out = sweep_rules.hold(queued, active, limits)
    assert set(out) == set(held)
    for job_id, kind in held.items():
        sweep = next(m.sweep_id for m in queued if m.job_id == job_id)
        assert (
            f"sweep {sweep} has {active.get(sweep, 0)} of max_parallel {limits[sweep]} members running" in out[job_id]
        )
        assert ("lower index" in out[job_id]) == (kind == "free")


def s(index: int, value: float | None, state: str = "SUCCEEDED") -> Scored:
    return Scored(index, state, value)


@pytest.mark.parametrize(
    ("members", "mode", "ranked", "best"),
    [
        ([], "min", [], None),
        ([s(0, None), s(1, None)], "min", [], None),
        ([s(0, 0.5), s(1, 0.2), s(2, None)], "min", [1, 0], 1),
        ([s(0, 0.5), s(1, 0.2)], "max", [0, 1], 0),
        ([s(0, 0.3), s(1, 0.3)], "min", [0, 1], 0),  # ties: the lower index
        ([s(0, 0.1, "FAILED"), s(1, 0.5)], "min", [1, 0], 1),  # failed ones rank after the others
        ([s(0, 0.1, "CANCELLED"), s(1, 0.2, "FAILED")], "min", [0, 1], None),  # none did not fail: no best
        ([s(0, 0.4, "RUNNING"), s(1, 0.6)], "min", [0, 1], 0),  # while members run: the leader so far
        ([s(0, float("inf")), s(1, 2.0)], "min", [1], 1),
    ],
)  # fmt: skip
def test_rank_and_best(members: list[Scored], mode: str, ranked: list[int], best: int | None) -> None:
    assert sweep_rules.rank(members, mode) == ranked
    assert sweep_rules.best(members, mode) == best


# ---- round trip ------------------------------------------------------------------------------------------------
# Config keys (a key that starts with a spec field, e.g. "queue", would set that field to any JSON value).
keys = st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True).filter(lambda k: k not in {*SPEC_ROOTS, "name"})


@st.composite
def sweep_bodies(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {"base": draw(spec_bodies())}
    if draw(st.booleans()):
        body["grid"] = draw(
            st.dictionaries(keys, st.lists(json_values, min_size=1, max_size=3), min_size=1, max_size=3)
        )
    if draw(st.booleans()):
        taken = set(body.get("grid", {}))
        body["points"] = draw(st.lists(st.dictionaries(keys.filter(lambda k: k not in taken), json_values, max_size=2),
                                       min_size=1, max_size=3))  # fmt: skip
    if draw(st.booleans()) or not (body.get("grid") or body.get("points")):
        body["count"] = draw(st.integers(1, 3))
    if draw(st.booleans()):
        body["max_parallel"] = draw(st.integers(1, 10))
    if draw(st.booleans()):
        body["metric"] = {
            "name": draw(st.sampled_from(["loss", "eval/acc"])),
            "mode": draw(st.sampled_from(["min", "max"])),
        }
    if draw(st.booleans()):
        body["name"] = draw(st.from_regex(r"[a-z][a-z0-9-]{0,10}", fullmatch=True))
    return body


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sweep_bodies())
def test_request_round_trips(body: dict[str, Any]) -> None:
    request = SweepRequest.model_validate(body)
    assert SweepRequest.model_validate(request.model_dump(mode="json")) == request
    assert SweepRequest.model_validate(request.model_dump(mode="json", exclude_unset=True)) == request


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
@given(body=sweep_bodies())
def test_stored_request_and_members_read_back(db: Engine, tmp_path: Path, body: dict[str, Any]) -> None:
    request = SweepRequest.model_validate(body)
    queues: dict[str, Any] = {q: {} for q in ("default", "gpu", "batch-2", "a_b")}  # what spec_bodies draws
    # spec_bodies draws notify entries too: with or without their own secret, to any address.
    conf = Settings(database_url=str(db.url), data_dir=tmp_path, queues=queues,
                    webhook_secret="roundtrip-secret-0123", webhook_allow_private=True)  # fmt: skip
    with Session(db) as session:
        for dep in getattr(request.base, "depends_on", None) or []:  # the jobs its members depend on exist, and run
            if session.get(Job, dep.job) is None:
                session.add(Job(id=dep.job, name="dep", owner="roundtrip", state=JobState.RUNNING, spec={}))
        session.flush()
        sweep, _ = sweeps.create(session, request, caller=Caller(), settings=conf)
        session.commit()
        sweep_id = sweep.id
    with Session(db) as session:
        stored = session.get(Sweep, sweep_id)
        assert stored is not None and SweepRequest.model_validate(stored.request) == request
        rows = session.exec(select(Job).where(Job.sweep_id == sweep_id).order_by(Job.sweep_index)).all()
        expected = member_specs(request)
        assert [r.sweep_index for r in rows] == list(range(len(expected)))
        assert [JobSpec.model_validate(r.spec) for r in rows] == [spec for _, spec in expected]
        assert stored.values == [values for values, _ in expected]


# ---- on a real database ------------------------------------------------------------------------------------------
def conf_for(db: Engine, tmp_path: Path, **extra: Any) -> Settings:
    return Settings(database_url=str(db.url), data_dir=tmp_path, **extra)


def make(db: Engine, tmp_path: Path, caller: Caller = ALICE, **body: Any) -> str:
    with Session(db) as session:
        sweep, created = sweeps.create(session, req(**body), caller=caller, settings=conf_for(db, tmp_path))
        session.commit()
        assert created
        return sweep.id


def states(db: Engine, sweep_id: str) -> list[str]:
    with Session(db) as session:
        rows = session.exec(select(Job).where(Job.sweep_id == sweep_id).order_by(Job.sweep_index)).all()
        return [JobState(r.state).value for r in rows]


def test_all_members_or_none(db: Engine, tmp_path: Path) -> None:
    """A member the job rules refuse (here: an unknown queue, swept) refuses the whole sweep; nothing is stored."""
    with Session(db) as session, pytest.raises(InvalidSpec) as info:
        sweeps.create(session, req(grid={"queue": ["default", "nope"]}), caller=ALICE, settings=conf_for(db, tmp_path))
    assert info.value.field == "queue" and "member 1" in info.value.detail
    with Session(db) as session:
        assert session.exec(select(Job)).all() == [] and session.exec(select(Sweep)).all() == []


def test_member_cap_is_a_setting(db: Engine, tmp_path: Path) -> None:
    with Session(db) as session, pytest.raises(InvalidSpec) as info:
        sweeps.create(session, req(grid={"lr": [1, 2, 3]}, count=2), caller=ALICE,
                      settings=conf_for(db, tmp_path, max_sweep_members=5))  # fmt: skip
    assert info.value.field == "grid" and "6 members" in info.value.detail


def test_idempotent_create(db: Engine, tmp_path: Path) -> None:
    conf = conf_for(db, tmp_path)
    with Session(db) as session:
        first, created = sweeps.create(session, req(count=2), caller=ALICE, settings=conf, idempotency_key="k")
        session.commit()
        again, created_again = sweeps.create(session, req(count=2), caller=ALICE, settings=conf, idempotency_key="k")
        assert (created, created_again, again.id) == (True, False, first.id)
        with pytest.raises(Conflict):
            sweeps.create(session, req(count=3), caller=ALICE, settings=conf, idempotency_key="k")
    assert states(db, first.id) == ["QUEUED", "QUEUED"]


def _admit(db: Engine, settings: Settings, cpus: float, now: datetime) -> list[str]:
    from service.core.backend import ClusterView, NodeView
    from service.dispatch import admission

    view = ClusterView([NodeView("n" * 56, "10.0.0.1", True, {"CPU": cpus}, {"CPU": cpus})])
    spec_of = lambda j: (JobSpec.model_validate(j.spec), None)  # noqa: E731
    resources_of = lambda j: JobSpec.model_validate(j.spec).resources.total(j.world_size)  # noqa: E731
    started, _ = admission.admit(db, settings, view, owner="test", now=now, spec_of=spec_of, resources_of=resources_of)
    return [j.id for j in started]


def _end(db: Engine, job_id: str) -> None:
    with Session(db) as session:
        job = session.get(Job, job_id)
        assert job is not None
        transition(session, job, to=JobState.SUCCEEDED, reason="succeeded", values={"end_reason": EndReason.SUCCEEDED})
        session.commit()


def test_max_parallel_holds_members_and_blocks_nobody_behind_them(db: Engine, tmp_path: Path) -> None:
    """Four members at max_parallel 1 and an ordinary job submitted after them, with room for all and a pass that
    reads only 2 queued jobs: the pass admits member 0 and the job (the held members are not even read); member 1
    follows only once member 0 has ended."""
    sweep_id = make(db, tmp_path, grid={"lr": [1, 2, 3, 4]}, max_parallel=1)
    conf = conf_for(db, tmp_path, admit_batch=2)
    with Session(db) as session:
        later = Job(name="later", owner="bob", spec=JobSpec.model_validate(BASE).model_dump(mode="json"))
        session.add(later)
        session.commit()
        later_id = later.id
    with Session(db) as session:
        ids = [j.id for j in session.exec(select(Job).where(Job.sweep_id == sweep_id).order_by(Job.sweep_index))]
    assert sorted(_admit(db, conf, 8, NOW)) == sorted([ids[0], later_id])
    assert states(db, sweep_id) == ["STARTING", "QUEUED", "QUEUED", "QUEUED"]
    assert _admit(db, conf, 8, NOW + timedelta(seconds=1)) == []  # still one active
    with Session(db) as session:
        held = session.get(Job, ids[1])
        assert held is not None and held.state_reason == f"sweep {sweep_id} has 1 of max_parallel 1 members running"
    _end(db, ids[0])
    assert _admit(db, conf, 8, NOW + timedelta(seconds=2)) == [ids[1]]
    assert states(db, sweep_id) == ["SUCCEEDED", "STARTING", "QUEUED", "QUEUED"]


def test_max_parallel_two_and_sweeps_apart(db: Engine, tmp_path: Path) -> None:
    limited = make(db, tmp_path, count=3, max_parallel=2)
    free = make(db, tmp_path, count=3)  # no max_parallel: ordinary jobs
    assert len(_admit(db, conf_for(db, tmp_path), 16, NOW)) == 5
    assert states(db, limited) == ["STARTING", "STARTING", "QUEUED"]
    assert states(db, free) == ["STARTING"] * 3


def _report(db: Engine, job_id: str, losses: list[float], name: str = "loss") -> None:
    with Session(db) as session:
        for step, value in enumerate(losses, start=1):
            session.add(Metric(job_id=job_id, attempt=1, step=step, name=name, value=value))
        session.commit()


def test_status_ranks_by_the_last_reported_value(db: Engine, tmp_path: Path) -> None:
    sweep_id = make(db, tmp_path, grid={"lr": [1, 2, 3, 4]}, metric={"name": "loss", "mode": "min"})
    with Session(db) as session:
        ids = [j.id for j in session.exec(select(Job).where(Job.sweep_id == sweep_id).order_by(Job.sweep_index))]
    _report(db, ids[0], [0.9, 0.1, 0.5])  # best-ever 0.1, but it ended at 0.5
    _report(db, ids[1], [0.8, 0.3])
    _report(db, ids[2], [0.05], name="other")  # not the sweep's metric
    _report(db, ids[3], [0.7, 0.01])
    with Session(db) as session:
        job = session.get(Job, ids[3])
        assert job is not None
        transition(session, job, to=JobState.FAILED, reason="user_error", values={"end_reason": EndReason.USER_ERROR})
        session.commit()
    with Session(db) as session:
        st_ = sweeps.status(session, sweeps.get(session, sweep_id, caller=ALICE))
    by_index = {m.job.sweep_index: m for m in st_.members}
    assert by_index[0].metric == sweeps.MetricValues(last=0.5, best=0.1)
    assert [by_index[i].rank for i in range(4)] == [2, 1, None, 3]  # the failed one ranks last
    assert st_.best is not None and st_.best.job.id == ids[1]
    assert st_.counts == {"QUEUED": 3, "FAILED": 1} and not st_.done


def test_cancel_reaches_every_live_member_and_hides_from_others(db: Engine, tmp_path: Path) -> None:
    from service.core.errors import NotFound

    sweep_id = make(db, tmp_path, count=3, max_parallel=1)
    [first] = _admit(db, conf_for(db, tmp_path), 8, NOW)
    with Session(db) as session:
        with pytest.raises(NotFound):
            sweeps.cancel(session, sweep_id, caller=Caller(owner="bob", admin=False))
        with pytest.raises(NotFound):
            sweeps.get(session, sweep_id, caller=Caller(owner="bob", admin=False))
        assert sweeps.get(session, sweep_id, caller=Caller(owner="ops", admin=True)).id == sweep_id
        sweep, asked = sweeps.cancel(session, sweep_id, caller=ALICE)
        session.commit()
        assert len(asked) == 3 and sweep.cancelled_at is not None
    assert states(db, sweep_id) == ["CANCELLING", "CANCELLED", "CANCELLED"]
    with Session(db) as session:
        _, again = sweeps.cancel(session, sweep_id, caller=ALICE)  # CANCELLING is asked again, harmlessly
        assert again == [first]


def test_members_keep_the_base_notify_entrys_write_only_secret(db: Engine, tmp_path: Path) -> None:
    """A notify secret is never dumped, so a member built from the base's dump would lose it and be signed with the
    cluster's secret: each member keeps its own copy, and the sweep's stored request has none."""
    from service.store.notify_tables import NotifySecret

    secret = "s3cret-of-at-least-16"
    notify = [{"url": "https://hooks.example.com/done", "secret": secret}]
    with Session(db) as session:
        request = SweepRequest.model_validate({"base": {**BASE, "notify": notify}, "count": 2})
        sweep, _ = sweeps.create(session, request, caller=ALICE, settings=conf_for(db, tmp_path))
        session.commit()
        rows = session.exec(select(Job).where(Job.sweep_id == sweep.id)).all()
        kept = session.exec(select(NotifySecret).where(col(NotifySecret.job_id).in_([r.id for r in rows]))).all()
        assert sorted((k.target, k.secret) for k in kept) == [(0, secret), (0, secret)]
        assert secret not in json.dumps(sweep.request) and secret not in json.dumps([r.spec for r in rows])
