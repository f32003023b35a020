"""Usage accounting (issue 15) on SQLite and PostgreSQL: CPU/GPU-hours clipped to the window, running attempts up to
now, filters, ended jobs, queue-wait percentiles; `GET /v1/usage` with its 403/422s, `shunter usage`, and the
`shunter_resource_seconds_total` counters on /metrics, over real HTTP."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import delete
from sqlalchemy.engine import Engine
from sqlmodel import Session, select
from typer.testing import CliRunner

from api.cli import app as cli
from service.collectors import DatabaseCollector
from service.core.errors import InvalidSpec
from service.lifecycle import jobs
from service.lifecycle.state import transition
from service.spec.job import JobSpec
from service.store.models import Attempt, EndReason, Job, JobEvent, JobState, utcnow
from service.tenancy import usage
from service.tenancy.auth import Caller
from tests.api.conftest import GOOD
from tests.live_api import live_api

T0 = datetime(2025, 3, 3, tzinfo=timezone.utc)
H = timedelta(hours=1)
UNTIL = T0 + 10 * H
NOW = T0 + 12 * H
TOKENS = {
    "tok-alice": {"owner": "alice", "team": "ml"},
    "tok-bob": {"owner": "bob"},
    "tok-root": {"owner": "ops", "admin": True},
}


def _job(session: Session, owner: str, *, team: str | None = None, queue: str = "default", created: datetime) -> Job:
    spec = JobSpec.model_validate({**GOOD, "queue": queue})
    job, _ = jobs.submit(session, spec, caller=Caller(owner=owner, team=team))
    job.created_at = created  # submitted at a chosen time, so waits are exact
    session.commit()
    return job


def _attempt(
    session: Session, job: Job, start: datetime, end: datetime | None = None, *, cpus: float, gpus: float = 0.0,
    to: JobState | None = None, reason: EndReason = EndReason.SUCCEEDED,
) -> None:  # fmt: skip
    """An admission at `start` holding `cpus`/`gpus`; with `end`, the attempt ends then and the job goes `to`."""
    number = job.attempt + 1
    transition(session, job, to=JobState.STARTING, reason="admitted", values={"attempt": number}, now=start)
    attempt = Attempt(job_id=job.id, number=number, submission_id=f"shunter-{job.id}-{number}", started_at=start,
                      ended_at=end, end_reason=reason if end else None, cpus=cpus, gpus=gpus)  # fmt: skip
    session.add(attempt)
    if end is not None and to is not None:
        values = {} if to is JobState.QUEUED else {"end_reason": reason}
        transition(session, job, to=to, reason=reason.value, values=values, now=end)
    session.commit()


def _history(engine: Engine) -> None:
    """alice (team ml) and bob over [T0, T0+10h), carol before it and at its end; see the expected numbers below."""
    with Session(engine, expire_on_commit=False) as s:
        a1 = _job(s, "alice", team="ml", created=T0 - 2 * H)
        _attempt(s, a1, T0 - H, T0 + 2 * H, cpus=2, gpus=1, to=JobState.SUCCEEDED)  # 2 h inside: 4 CPU-h, 2 GPU-h
        a2 = _job(s, "alice", team="ml", created=T0 + H)
        _attempt(s, a2, T0 + 1.1 * H, T0 + 3 * H, cpus=4, to=JobState.QUEUED, reason=EndReason.WORKER_LOST)  # 7.6
        _attempt(s, a2, T0 + 4 * H, T0 + 11 * H, cpus=4, to=JobState.FAILED, reason=EndReason.USER_ERROR)  # 24 in
        b1 = _job(s, "bob", queue="gpu", created=T0 + 2 * H)
        _attempt(s, b1, T0 + 2.5 * H, cpus=1, gpus=2)  # still running: 7.5 h to UNTIL, 9.5 h to NOW
        b2 = _job(s, "bob", queue="gpu", created=T0 + 4 * H)
        transition(s, b2, to=JobState.CANCELLED, reason="cancel_requested", values={"end_reason": "cancelled"},
                   now=T0 + 5 * H)  # fmt: skip
        s.commit()
        c1 = _job(s, "carol", team="ml", created=T0 - 5 * H)
        _attempt(s, c1, T0 - 4 * H, T0 - 3 * H, cpus=1, to=JobState.SUCCEEDED)  # before the window
        c2 = _job(s, "carol", team="ml", created=T0 + 9 * H)
        _attempt(s, c2, UNTIL, cpus=2)  # starts as the window ends: not in it


def _cells(report: usage.UsageReport) -> dict[tuple[str, str | None, str], tuple[float, float, int]]:
    return {(r.owner, r.team, r.queue): (r.cpu_hours, r.gpu_hours, r.attempts) for r in report.rows}


def test_window_is_clipped_and_jobs_counted(db: Engine) -> None:
    _history(db)
    with Session(db) as s:
        r = usage.report(s, since=T0, until=UNTIL, now=NOW)
        assert _cells(r) == {("alice", "ml", "default"): (35.6, 2.0, 3), ("bob", None, "gpu"): (7.5, 15.0, 1)}
        assert (r.totals.cpu_hours, r.totals.gpu_hours, r.totals.attempts) == (43.1, 17.0, 4)
        assert r.jobs_ended == {"SUCCEEDED": 1, "FAILED": 0, "CANCELLED": 1}
        assert r.end_reasons == {"cancelled": 1, "succeeded": 1}
        assert r.queue_wait == usage.QueueWait(jobs=2, p50=360.0, p90=1800.0, p99=1800.0)
        # An attempt that ended exactly at `since` is not in the window; the running one counts from its start.
        edge = usage.report(s, since=T0 + 2 * H, until=T0 + 3 * H, now=NOW)
        assert _cells(edge) == {("alice", "ml", "default"): (4.0, 0.0, 1), ("bob", None, "gpu"): (0.5, 1.0, 1)}


def test_running_attempts_count_up_to_now(db: Engine) -> None:
    _history(db)
    with Session(db) as s:
        to_now = usage.report(s, since=T0, now=NOW)
        assert _cells(to_now) == {("alice", "ml", "default"): (39.6, 2.0, 3), ("bob", None, "gpu"): (9.5, 19.0, 1),
                                  ("carol", "ml", "default"): (4.0, 0.0, 1)}  # fmt: skip
        assert to_now.jobs_ended == {"SUCCEEDED": 1, "FAILED": 1, "CANCELLED": 1}
        assert usage.report(s, since=T0, until=NOW + 5 * H, now=NOW).rows == to_now.rows  # the future holds nothing
        assert usage.report(s, now=NOW).totals.cpu_hours == 56.1  # all history: alice 41.6, bob 9.5, carol 5


def test_filters_combine(db: Engine) -> None:
    _history(db)
    with Session(db) as s:

        def cells(**filters: str) -> dict[tuple[str, str | None, str], tuple[float, float, int]]:
            return _cells(usage.report(s, since=T0, until=UNTIL, now=NOW, **filters))

        assert cells(owner="alice") == {("alice", "ml", "default"): (35.6, 2.0, 3)}
        assert cells(team="ml") == cells(queue="default") == cells(owner="alice")
        assert cells(queue="gpu") == {("bob", None, "gpu"): (7.5, 15.0, 1)}
        assert cells(owner="alice", queue="gpu") == {} and cells(owner="bob", team="ml") == {}
        bob = usage.report(s, owner="bob", since=T0, until=UNTIL, now=NOW)
        assert bob.jobs_ended == {"SUCCEEDED": 0, "FAILED": 0, "CANCELLED": 1}
        assert bob.queue_wait == usage.QueueWait(jobs=1, p50=1800.0, p90=1800.0, p99=1800.0)
        nobody = usage.report(s, owner="nobody", since=T0, until=UNTIL, now=NOW)
        assert nobody.queue_wait == usage.QueueWait(jobs=0, p50=None, p90=None, p99=None)
        with pytest.raises(InvalidSpec) as refused:
            usage.report(s, since=UNTIL, until=UNTIL, now=NOW)
        assert refused.value.field == "since"


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([], (None, None, None)),
        ([7.0], (7.0, 7.0, 7.0)),
        ([float(v) for v in range(10, 0, -1)], (5.0, 9.0, 10.0)),
        ([float(v) for v in range(1, 101)], (50.0, 90.0, 99.0)),
        ([float(v) for v in range(1, 201)], (100.0, 180.0, 198.0)),
        ([3.0, 1.0, 2.0], (2.0, 3.0, 3.0)),
        ([5.0, 4.0, 3.0, 2.0, 1.0], (3.0, 5.0, 5.0)),  # ranks 2.5 and 4.5 go up, never to the even neighbour
    ],
)
def test_nearest_rank_percentiles(values: list[float], expected: tuple[float | None, ...]) -> None:
    wait = usage.queue_wait(values)
    assert (wait.jobs, wait.p50, wait.p90, wait.p99) == (len(values), *expected)


def _get(url: str, token: str | None = None, **params: str) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.get(f"{url}/v1/usage", params=params, headers=headers, timeout=10)


def test_api_window_visibility_and_errors(db: Engine, tmp_path: Path) -> None:
    _history(db)
    window = {"since": T0.isoformat(), "until": UNTIL.isoformat()}
    with live_api(db, tmp_path, api_tokens=TOKENS) as api:
        body = _get(api.url, "tok-root", **window).json()
        rows = {(r["owner"], r["team"], r["queue"]): (r["cpu_hours"], r["gpu_hours"], r["attempts"])
                for r in body["rows"]}  # fmt: skip
        assert rows == {("alice", "ml", "default"): (35.6, 2.0, 3), ("bob", None, "gpu"): (7.5, 15.0, 1)}
        assert body["totals"] == {"cpu_hours": 43.1, "gpu_hours": 17.0, "attempts": 4, "gpu_hours_by_type": {}}
        assert body["jobs_ended"] == {"SUCCEEDED": 1, "FAILED": 0, "CANCELLED": 1}
        assert body["queue_wait"] == {"jobs": 2, "p50": 360.0, "p90": 1800.0, "p99": 1800.0}
        # The same instants written in another zone, or without one (UTC), are the same window.
        shifted = {"since": "2025-03-03T02:00:00+02:00", "until": "2025-03-03T10:00:00"}
        assert _get(api.url, "tok-root", **shifted).json()["rows"] == body["rows"]

        mine = _get(api.url, "tok-alice", **window).json()
        assert [r["owner"] for r in mine["rows"]] == ["alice"] and mine["totals"]["cpu_hours"] == 35.6
        assert _get(api.url, "tok-alice", owner="alice", **window).json() == mine
        refused = _get(api.url, "tok-alice", owner="bob")
        assert (refused.status_code, refused.json()["field"], refused.json()["code"]) == (403, "owner", "forbidden")
        assert _get(api.url, "tok-root", owner="bob", **window).json()["totals"]["cpu_hours"] == 7.5
        assert _get(api.url).status_code == 401

        default = _get(api.url, "tok-root").json()
        since, until = (datetime.fromisoformat(default[k]) for k in ("since", "until"))
        assert until - since == timedelta(days=7) and abs(until - utcnow()) < timedelta(minutes=1)
        for params, field in [
            ({"since": "yesterday"}, "since"),
            ({"since": "1741000000"}, "since"),  # Unix seconds are not ISO-8601
            ({"until": "2025-13-01T00:00:00"}, "until"),
            ({"since": UNTIL.isoformat(), "until": T0.isoformat()}, "since"),
            (window | {"since": UNTIL.isoformat()}, "since"),
            ({"since": "0001-01-01T00:00:00+05:00"}, "since"),  # no such instant in UTC
            ({"until": "0001-01-02T00:00:00"}, "until"),  # the default since would be before year 1
            ({"owner": "x" * 129}, "owner"),
        ]:
            r = _get(api.url, "tok-root", **params)
            assert (r.status_code, r.json().get("field")) == (422, field), (params, r.text)


def test_open_service_is_everyones(db: Engine, tmp_path: Path) -> None:
    """Without tokens every caller is an admin: the report covers every owner."""
    _history(db)
    with live_api(db, tmp_path) as api:
        body = _get(api.url, since=T0.isoformat(), until=UNTIL.isoformat()).json()
        assert [r["owner"] for r in body["rows"]] == ["alice", "bob"]


def test_cli_table_json_and_errors(db: Engine, tmp_path: Path) -> None:
    _history(db)
    runner = CliRunner()
    window = ["--since", T0.isoformat(), "--until", UNTIL.isoformat()]
    with live_api(db, tmp_path, api_tokens=TOKENS) as api:
        common = ["--server", api.url, "--token", "tok-root"]
        table = runner.invoke(cli, ["usage", *common, *window], env={"COLUMNS": "120"})
        assert table.exit_code == 0, table.output
        lines = [" ".join(line.replace("│", " ").split()) for line in table.stdout.splitlines()]
        assert "alice ml default 35.60 2.00 3" in lines and "bob gpu 7.50 15.00 1" in lines
        assert "total 43.10 17.00 4" in lines
        assert "jobs ended: SUCCEEDED 1 FAILED 0 CANCELLED 1" in lines
        assert "queue wait (2 jobs): p50 360s p90 1800s p99 1800s" in lines

        raw = runner.invoke(cli, ["usage", *common, *window, "--team", "ml", "--json"])
        assert raw.exit_code == 0, raw.output
        assert json.loads(raw.stdout) == _get(api.url, "tok-root", team="ml", since=window[1], until=window[3]).json()

        bad = runner.invoke(cli, ["usage", *common, "--since", "not-a-time"])
        assert bad.exit_code == 1 and "since" in bad.stderr
        forbidden = runner.invoke(cli, ["usage", "--server", api.url, "--token", "tok-bob", "--owner", "alice"])
        assert forbidden.exit_code == 1 and "403" in forbidden.stderr


def _scrape(url: str) -> dict[tuple[str, str, str], float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {(s.labels["owner"], s.labels["queue"], s.labels["resource"]): s.value
            for family in text_string_to_metric_families(text) if family.name == "shunter_resource_seconds"
            for s in family.samples if s.name == "shunter_resource_seconds_total"}  # fmt: skip


def test_resource_seconds_counters(db: Engine, tmp_path: Path) -> None:
    _history(db)
    with live_api(db, tmp_path) as api:
        before = utcnow()
        seen = _scrape(api.url)
        after = utcnow()
    ended = {
        ("alice", "default", "cpu"): 2 * 3 * 3600 + 4 * 1.9 * 3600 + 4 * 7 * 3600,
        ("alice", "default", "gpu"): 1 * 3 * 3600,
        ("carol", "default", "cpu"): 1 * 3600,  # ...plus c2, running
        ("carol", "default", "gpu"): 0,
        ("bob", "gpu", "cpu"): 0,  # b1 runs; b2 never did
        ("bob", "gpu", "gpu"): 0,
    }
    running = {("bob", "gpu", "cpu"): (T0 + 2.5 * H, 1), ("bob", "gpu", "gpu"): (T0 + 2.5 * H, 2),
               ("carol", "default", "cpu"): (UNTIL, 2)}  # fmt: skip
    assert set(seen) == set(ended)
    for labels, value in ended.items():
        start, held = running.get(labels, (before, 0))
        low = value + held * (before - start).total_seconds()
        high = value + held * (after - start).total_seconds()
        # SQLite's julianday() keeps milliseconds: allow for them.
        assert low - 0.01 <= seen[labels] <= high + 0.01, (labels, seen[labels], low, high)


def test_resource_counter_never_goes_down(db: Engine) -> None:
    """An end recorded a moment before a scrape that counted the attempt up to then must not read as a reset."""
    collector = DatabaseCollector(db)

    def cpu_seconds() -> float:
        family = next(m for m in collector.collect() if m.name == "shunter_resource_seconds")
        return next(s.value for s in family.samples if s.labels["resource"] == "cpu")

    start = utcnow() - 100 * timedelta(seconds=1)
    with Session(db, expire_on_commit=False) as s:
        _attempt(s, _job(s, "alice", created=start), start, cpus=2)
        running = cpu_seconds()
        assert running >= 200
        attempt = s.exec(select(Attempt)).one()
        attempt.ended_at = start + timedelta(seconds=50)
        s.commit()
    assert cpu_seconds() == running


MINUTE = timedelta(minutes=1)
attempt_st = st.tuples(
    st.sampled_from(["alice", "bob", "carol"]),
    st.sampled_from(["default", "gpu"]),
    st.integers(0, 1200),  # start, in minutes after T0
    st.one_of(st.none(), st.integers(0, 900)),  # duration; None: still running
    st.sampled_from([0.0, 0.5, 1.0, 2.0, 4.0]),
    st.sampled_from([0.0, 1.0, 8.0]),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(attempts=st.lists(attempt_st, max_size=6), cuts=st.lists(st.integers(0, 2400), min_size=3, max_size=3))
def test_totals_sum_rows_and_windows_add_up(db: Engine, attempts: list[tuple], cuts: list[int]) -> None:
    a, b, c = (T0 + m * MINUTE for m in sorted(cuts))
    now = T0 + 2000 * MINUTE
    with Session(db, expire_on_commit=False) as s:
        for table in (Attempt, JobEvent, Job):
            s.execute(delete(table))
        for owner, queue, start, minutes, cpus, gpus in attempts:
            job = _job(s, owner, queue=queue, created=T0)
            end = None if minutes is None else T0 + (start + minutes) * MINUTE
            _attempt(s, job, T0 + start * MINUTE, end, cpus=cpus, gpus=gpus, to=JobState.SUCCEEDED)

        def seconds(since: datetime, until: datetime) -> dict[tuple[str, str | None, str], tuple[float, float]]:
            if since >= until:
                return {}
            r = usage.report(s, since=since, until=until, now=now)
            assert r.totals.cpu_seconds == sum(row.cpu_seconds for row in r.rows)
            assert r.totals.gpu_seconds == sum(row.gpu_seconds for row in r.rows)
            assert r.totals.attempts == sum(row.attempts for row in r.rows)
            return {(row.owner, row.team, row.queue): (row.cpu_seconds, row.gpu_seconds) for row in r.rows}

        first, second, whole = seconds(a, b), seconds(b, c), seconds(a, c)
        for key in first.keys() | second.keys() | whole.keys():
            parts = [part.get(key, (0.0, 0.0)) for part in (first, second)]
            # Whole minutes times multiples of a half are exact in floating point: the sums must match exactly.
            assert tuple(x + y for x, y in zip(*parts, strict=True)) == whole.get(key, (0.0, 0.0)), key


def test_gpu_hours_are_counted_by_accelerator_type(db: Engine) -> None:
    """Issue 37: a job that asks for an accelerator type (the spec's field, or Ray's raw resource key) has its
    GPU-hours counted under that type too, in its row and in the totals; an untyped job's are not."""
    with Session(db, expire_on_commit=False) as s:
        typed = []
        for resources in ({"accelerator_type": "A100"}, {"resources_per_worker": {"accelerator_type:H100": 0.001}}):
            spec = JobSpec.model_validate({**GOOD, "resources": {"num_workers": 1, "use_gpu": True, **resources}})
            job, _ = jobs.submit(s, spec, caller=Caller(owner="alice"))
            job.created_at = T0
            s.commit()
            typed.append(job)
        assert [j.accelerator_type for j in typed] == ["A100", "H100"]
        _attempt(s, typed[0], T0, T0 + 2 * H, cpus=1, gpus=4, to=JobState.SUCCEEDED)  # 8 GPU-h of A100
        _attempt(s, typed[1], T0, T0 + H, cpus=1, gpus=2, to=JobState.SUCCEEDED)  # 2 GPU-h of H100
        plain = _job(s, "alice", created=T0)
        _attempt(s, plain, T0, T0 + H, cpus=1, gpus=1, to=JobState.SUCCEEDED)  # 1 GPU-h of no type
        r = usage.report(s, since=T0, until=UNTIL, now=NOW)
    (row,) = r.rows
    assert row.gpu_hours == 11.0 and row.gpu_hours_by_type == {"A100": 8.0, "H100": 2.0}
    assert r.totals.gpu_hours_by_type == {"A100": 8.0, "H100": 2.0}
