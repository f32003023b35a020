"""The second audit (issue 35): storage and spec bytes an owner may hold. Item 7's per-owner archive quota and the
expiry of archives nobody uses; item 3's per-owner bytes of specs in jobs that have not ended. Each test failed on the
main it was written against. Quick tier: the public API over real HTTP (`tests.live_api`) on a SQLite file and on
PostgreSQL, the dispatcher's expiry pass driven by hand under a virtual clock (`service.core.clock`)."""

from __future__ import annotations

import io
import json
import os
import zipfile
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from service.backends.noop import NoopJobs
from service.config.settings import Settings
from service.core import clock
from service.dispatch.dispatcher import Dispatcher
from service.lifecycle.jobs import submit
from service.spec.job import JobSpec
from service.store import spec_budget
from service.store.db import make_engine
from service.store.migrate import upgrade
from service.store.models import CodeArchive, Job, JobState
from service.store.spec_cache import stored_size
from service.tenancy import attempt_tokens
from service.tenancy.auth import Caller
from tests.live_api import LiveApi, live_api
from tests.service.conftest import db, fresh_pg_database  # noqa: F401 - the fixture

SPEC = {"entrypoint": {"callable": "examples.mlp:train_loop"}, "resources": {"num_workers": 1}}
ALICE, BOB = "alice-token", "bob-token"
TOKENS = {ALICE: {"owner": "alice"}, BOB: {"owner": "bob"}}
ZIP = "application/zip"


def _zip(size: int) -> bytes:
    """A stored (not deflated) zip of about `size` bytes of random content: its size on storage is predictable."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_STORED) as archive:
        archive.writestr("train.py", os.urandom(size))
    return buffer.getvalue()


def _as(token: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}", **extra}


def _upload(api: LiveApi, body: bytes, token: str = ALICE) -> httpx.Response:
    return httpx.post(f"{api.url}/v1/code", content=body, headers=_as(token, **{"Content-Type": ZIP}), timeout=30)


def _submit(api: LiveApi, spec: dict, token: str = ALICE) -> httpx.Response:
    return httpx.post(f"{api.url}/v1/jobs", json=spec, headers=_as(token), timeout=30)


@pytest.fixture
def quiet_keys() -> Iterator[None]:
    attempt_tokens.forget_cached_keys()
    yield
    attempt_tokens.forget_cached_keys()


# ---- 7. a per-owner quota on code archives -------------------------------------------------------------------------
def test_7_an_owners_archives_have_a_storage_quota_and_the_same_content_again_costs_nothing(
    db: Engine,  # noqa: F811 - the imported fixture
    tmp_path: Path,
    quiet_keys: None,
) -> None:
    """Archives had no per-owner bound: an owner could fill the storage with distinct zips. Now an upload past
    `max_code_bytes_per_owner` is a 413 naming `body` and the quota, and nothing of it is kept; the same content
    uploaded again is the same archive, at no cost; another owner's quota is their own."""
    first, second = _zip(40_000), _zip(40_000)
    quota = len(first) + len(second) - 1
    storage = tmp_path / "storage"
    with live_api(db, tmp_path, api_tokens=TOKENS, max_code_bytes_per_owner=quota, storage_uri=str(storage)) as api:
        made = _upload(api, first)
        assert made.status_code == 201, made.text
        for _ in range(3):  # the same bytes again: the same URI, and the quota does not move
            again = _upload(api, first)
            assert (again.status_code, again.json()["uri"]) == (201, made.json()["uri"]), again.text
        refused = _upload(api, second)
        assert (refused.status_code, refused.json()["field"]) == (413, "body"), refused.text
        assert "max_code_bytes_per_owner" in refused.json()["detail"] and f"({quota} bytes)" in refused.json()["detail"]
        assert _upload(api, second, BOB).status_code == 201  # bob's archives are counted apart
        assert _upload(api, first).status_code == 201  # still free for alice
    kept = sorted(p.relative_to(storage / "code").parts[0] for p in (storage / "code").rglob("*.zip"))
    assert kept == ["alice", "bob"]
    with Session(db) as session:
        rows = session.exec(select(CodeArchive).order_by(CodeArchive.owner)).all()
        assert [(r.owner, r.size) for r in rows] == [("alice", len(first)), ("bob", len(second))]


# ---- 7. archives nobody uses expire ---------------------------------------------------------------------------------
START = datetime(2026, 12, 1, tzinfo=timezone.utc)


@pytest.fixture
def virtual_clock() -> Iterator[clock.VirtualClock]:
    with clock.use(clock.VirtualClock(START)) as installed:
        assert isinstance(installed, clock.VirtualClock)
        yield installed


def _expiry_pass(api: LiveApi, tmp_path: Path) -> list[tuple[str, str]]:
    """One run of the dispatcher's periodic pass (a fresh dispatcher: its first pass is due at once)."""
    dispatcher = Dispatcher(engine=api.engine, settings=api.settings, ray=NoopJobs(tmp_path / "noop"), owner="d1")
    try:
        return dispatcher.chores.expire_code_archives()
    finally:
        dispatcher._pool.shutdown(wait=True)


def test_7_an_unused_archive_expires_and_one_a_queued_job_names_is_kept(
    db: Engine,  # noqa: F811 - the imported fixture
    tmp_path: Path,
    quiet_keys: None,
    virtual_clock: clock.VirtualClock,
) -> None:
    """Archives were kept for ever. The dispatcher's pass now deletes, file and row, an archive unused for
    `code_retention_days`; one that a job not yet ended names (a queued one's working_dir, a running one's
    py_modules) is kept however old, until that job has ended and the retention has passed again."""
    storage = tmp_path / "storage"
    with live_api(db, tmp_path, api_tokens=TOKENS, code_retention_days=30, storage_uri=str(storage)) as api:
        used, module, unused = (_upload(api, _zip(2000)).json() for _ in range(3))
        job = _submit(api, {**SPEC, "runtime_env": {"working_dir": used["uri"]}})
        assert job.status_code == 201, job.text
        runs = _submit(api, {**SPEC, "runtime_env": {"py_modules": [module["uri"]]}}).json()["id"]
        with Session(db) as session:  # admitted and running: not ended either
            session.get(Job, runs).state = JobState.RUNNING  # type: ignore[union-attr]
            session.commit()
        virtual_clock.advance(timedelta(days=29).total_seconds())
        assert _expiry_pass(api, tmp_path) == []  # not yet: 29 days unused
        virtual_clock.advance(timedelta(days=2).total_seconds())
        assert _expiry_pass(api, tmp_path) == [("alice", unused["sha256"])]
        kept = sorted([used["sha256"], module["sha256"]])
        assert sorted(p.stem for p in (storage / "code" / "alice").glob("*.zip")) == kept
        with Session(db) as session:
            assert sorted(r.sha256 for r in session.exec(select(CodeArchive)).all()) == kept
        # The queued job ends; the archive it named is then deleted once it has gone unused for the retention.
        assert httpx.post(f"{api.url}/v1/jobs/{job.json()['id']}/cancel", headers=_as(ALICE), timeout=10).is_success
        assert _expiry_pass(api, tmp_path) == []  # the pass before counted it as used: a queued job named it
        virtual_clock.advance(timedelta(days=31).total_seconds())
        assert _expiry_pass(api, tmp_path) == [("alice", used["sha256"])]  # the running job's archive stays
    assert [p.stem for p in (storage / "code" / "alice").glob("*.zip")] == [module["sha256"]]


def test_7_a_job_naming_an_expired_or_unknown_archive_is_refused(
    db: Engine,  # noqa: F811 - the imported fixture
    tmp_path: Path,
    quiet_keys: None,
    virtual_clock: clock.VirtualClock,
) -> None:
    """A job naming an archive that is no longer stored was queued, and failed only when Ray could not fetch its
    working_dir. Now it is a 422 naming `runtime_env.working_dir` at submission, for an expired archive and for one
    never uploaded (`py_modules` alike); uploading the same content again makes the URI good again."""
    body = _zip(2000)
    with live_api(db, tmp_path, api_tokens=TOKENS, code_retention_days=1) as api:
        archive = _upload(api, body).json()
        virtual_clock.advance(timedelta(days=2).total_seconds())
        assert _expiry_pass(api, tmp_path) == [("alice", archive["sha256"])]
        refused = _submit(api, {**SPEC, "runtime_env": {"working_dir": archive["uri"]}})
        assert (refused.status_code, refused.json()["field"]) == (422, "runtime_env.working_dir"), refused.text
        assert "upload it again" in refused.json()["detail"]
        never = archive["uri"].replace(archive["sha256"], "0" * 64)
        refused = _submit(api, {**SPEC, "runtime_env": {"working_dir": never}})
        assert (refused.status_code, refused.json()["field"]) == (422, "runtime_env.working_dir"), refused.text
        refused = _submit(api, {**SPEC, "runtime_env": {"py_modules": [never]}})
        assert (refused.status_code, refused.json()["field"]) == (422, "runtime_env.py_modules"), refused.text
        assert _upload(api, body).json()["uri"] == archive["uri"]
        assert _submit(api, {**SPEC, "runtime_env": {"working_dir": archive["uri"]}}).status_code == 201


def test_7_an_archive_stored_before_the_records_gets_its_row_when_first_used(
    db: Engine,  # noqa: F811 - the imported fixture
    tmp_path: Path,
    quiet_keys: None,
) -> None:
    """Archives uploaded by the release before have a file and no row: a submission naming one still works, and
    makes its row from the file (lazily: the migration does not read the storage), so it counts and can expire."""
    storage = tmp_path / "storage"
    body = _zip(3000)
    with live_api(db, tmp_path, api_tokens=TOKENS, storage_uri=str(storage)) as api:
        archive = _upload(api, body).json()
        with Session(db) as session:  # as the release before left it: the file alone
            session.delete(session.exec(select(CodeArchive)).one())
            session.commit()
        assert (storage / "code" / "alice" / f"{archive['sha256']}.zip").is_file()
        made = _submit(api, {**SPEC, "runtime_env": {"working_dir": archive["uri"]}})
        assert made.status_code == 201, made.text
    with Session(db) as session:
        row = session.exec(select(CodeArchive)).one()
        assert (row.owner, row.sha256, row.size) == ("alice", archive["sha256"], len(body))


# ---- 3. an owner's bytes of specs not yet ended --------------------------------------------------------------------
def test_3_an_owners_specs_not_yet_ended_have_a_byte_budget_and_others_still_submit(
    db: Engine,  # noqa: F811 - the imported fixture
    tmp_path: Path,
    quiet_keys: None,
) -> None:
    """One owner could queue specs without bound (a sweep's bound is per request). Now the jobs of an owner that have
    not ended hold at most `max_queued_spec_bytes_per_owner` bytes of specs: past it a job is a 429 naming `spec`, a
    sweep a 429 naming `base`, a retry a 429 too; another owner submits as before; an ended job frees its bytes."""
    spec = {**SPEC, "config": {"blob": "x" * 30_000}}
    size, small = (stored_size(JobSpec.model_validate(s).model_dump(mode="json")) for s in (spec, SPEC))
    budget = 3 * size + small + 100
    with live_api(db, tmp_path, api_tokens=TOKENS, max_queued_spec_bytes_per_owner=budget) as api:
        ids = [_submit(api, spec).json()["id"] for _ in range(3)]
        refused = _submit(api, spec)
        assert (refused.status_code, refused.json()["field"]) == (429, "spec"), refused.text
        assert "max_queued_spec_bytes_per_owner" in refused.json()["detail"]
        assert _submit(api, SPEC).status_code == 201  # a small one still fits
        assert _submit(api, spec, BOB).status_code == 201
        sweep = httpx.post(f"{api.url}/v1/sweeps", json={"base": spec, "count": 2}, headers=_as(ALICE), timeout=30)
        assert (sweep.status_code, sweep.json()["field"]) == (429, "base"), sweep.text
        assert httpx.post(f"{api.url}/v1/jobs/{ids[0]}/cancel", headers=_as(ALICE), timeout=10).is_success
        again = _submit(api, spec)
        assert again.status_code == 201, again.text
        retried = httpx.post(f"{api.url}/v1/jobs/{ids[0]}/retry", headers=_as(ALICE), timeout=10)
        assert (retried.status_code, retried.json()["field"]) == (429, "spec"), retried.text
    with Session(db) as session:
        assert {j.spec_bytes for j in session.exec(select(Job).where(Job.owner == "bob")).all()} == {size}
        assert spec_budget.held(session, "alice") == 3 * size + small


BEFORE_SPEC_BYTES = "c8f1a3e5d7b9"  # the revision before jobs.spec_bytes


@pytest.fixture(params=["sqlite", "postgres"])
def old_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    """A database of the release before `spec_bytes` (migrated to the revision before it), on either backend."""
    if request.param == "sqlite":
        engine = make_engine(f"sqlite:///{tmp_path / 'old.db'}")
        upgrade(engine, BEFORE_SPEC_BYTES)
        yield engine
        engine.dispose()
        return
    with fresh_pg_database() as url:
        engine = make_engine(url)
        upgrade(engine, BEFORE_SPEC_BYTES)
        yield engine
        engine.dispose()


def test_3_the_upgrade_fills_in_the_spec_bytes_of_existing_jobs(old_db: Engine) -> None:
    """Jobs stored before `spec_bytes` existed are counted too: the migration sets each from its stored spec's JSON,
    so an owner's queue from before the upgrade already takes its room in the budget."""
    old = sa.Table("jobs", sa.MetaData(), autoload_with=old_db)
    assert "spec_bytes" not in old.c
    specs = [JobSpec.model_validate({**SPEC, "config": {"blob": "é" * n}}).model_dump(mode="json") for n in (10, 5000)]
    rows = [Job(name=f"j{i}", owner="alice", spec=s, state=JobState.QUEUED) for i, s in enumerate(specs)]
    rows.append(Job(name="done", owner="alice", spec=specs[1], state=JobState.SUCCEEDED))
    with old_db.begin() as conn:
        conn.execute(sa.insert(old), [{c.name: getattr(r, c.name) for c in old.c} for r in rows])
    upgrade(old_db)
    with Session(old_db) as session:
        stored = {j.name: j.spec_bytes for j in session.exec(select(Job)).all()}
        assert stored == {"j0": len(json.dumps(specs[0])), "j1": len(json.dumps(specs[1])), "done": len(json.dumps(
            specs[1]))}  # fmt: skip
        assert spec_budget.held(session, "alice") == stored["j0"] + stored["j1"]
        settings = Settings(max_queued_spec_bytes_per_owner=stored["j0"] + stored["j1"] + 100)
        with pytest.raises(spec_budget.SpecBudgetExceeded) as refused:
            submit(session, JobSpec.model_validate(SPEC), caller=Caller("alice", admin=False), settings=settings)
        assert refused.value.field == "spec"
