"""Listing at scale: filters, cursor paging that stays stable while jobs arrive, and indexes that serve the order."""

from __future__ import annotations

from collections.abc import Callable

from fastapi.testclient import TestClient
from sqlalchemy import event, text
from sqlalchemy.engine import Engine
from sqlmodel import Session

from service.lifecycle import jobs
from service.spec.job import JobSpec
from service.tenancy.auth import Caller
from tests.api.conftest import GOOD, TOKENS


def _submit(session: Session, name: str, owner: str = "alice", queue: str = "default") -> str:
    spec = JobSpec.model_validate({**GOOD, "name": name, "queue": queue})
    job, _ = jobs.submit(session, spec, caller=Caller(owner=owner, admin=False))
    session.commit()
    return job.id


def test_paging_is_stable_while_jobs_are_added(db: Engine) -> None:
    """Both databases: every job that existed when paging began is seen exactly once, newest first."""
    admin = Caller(owner="ops", admin=True)
    with Session(db, expire_on_commit=False) as session:
        before = [_submit(session, f"old{i}") for i in range(7)]
        seen: list[str] = []
        cursor = None
        while True:
            rows = jobs.list_jobs(session, caller=admin, limit=3, before=cursor)
            seen += [j.id for j in rows]
            _submit(session, f"new{len(seen)}")  # arrives between pages; it is newer than any cursor
            if len(rows) < 3:
                break
            cursor = (rows[-1].created_at, rows[-1].id)
        assert seen == list(reversed(before))
        assert [j.name for j in jobs.list_jobs(session, caller=admin, name="old3")] == ["old3"]
        assert len(jobs.list_jobs(session, caller=admin, name="new", limit=100)) == 0  # exact names only
        assert len(jobs.list_jobs(session, caller=admin, owner="nobody")) == 0


def test_api_filters_and_cursor(app_client: Callable[..., TestClient]) -> None:
    alice, bob, root = (app_client(t, tokens=TOKENS) for t in ("tok-alice", "tok-bob", "tok-root"))
    a_ids = [alice.post("/v1/jobs", json={**GOOD, "name": f"a{i}", "queue": "gpu" if i % 2 else "default"}).json()["id"]
             for i in range(5)]  # fmt: skip
    bob.post("/v1/jobs", json={**GOOD, "name": "b0"})
    alice.post(f"/v1/jobs/{a_ids[0]}/cancel")
    seen, cursor = [], None
    while True:
        page = root.get("/v1/jobs", params={"owner": "alice", "limit": 2, **({"cursor": cursor} if cursor else {})})
        assert page.status_code == 200, page.text
        seen += [j["id"] for j in page.json()["items"]]
        bob.post("/v1/jobs", json={**GOOD, "name": "late"})
        cursor = page.json()["next_cursor"]
        if not cursor:
            break
    assert seen == list(reversed(a_ids))
    assert {j["name"] for j in alice.get("/v1/jobs", params={"queue": "gpu"}).json()["items"]} == {"a1", "a3"}
    assert [j["id"] for j in alice.get("/v1/jobs", params={"state": "CANCELLED"}).json()["items"]] == [a_ids[0]]
    assert [j["name"] for j in root.get("/v1/jobs", params={"name": "b0"}).json()["items"]] == ["b0"]
    bad = root.get("/v1/jobs", params={"cursor": "not-a-cursor"})
    assert bad.status_code == 422 and bad.json()["field"] == "cursor"
    assert root.get("/v1/jobs", params={"state": "BOGUS"}).status_code == 422


def _plans(engine: Engine, caller: Caller, **kwargs: object) -> str:
    """SQLite's plan for exactly the SQL that `list_jobs` runs."""
    captured: list[tuple[str, object]] = []

    def grab(_conn: object, _cur: object, statement: str, params: object, *_: object) -> None:
        captured.append((statement, params))

    event.listen(engine, "before_cursor_execute", grab)
    try:
        with Session(engine) as session:
            jobs.list_jobs(session, caller=caller, limit=51, **kwargs)  # type: ignore[arg-type]
    finally:
        event.remove(engine, "before_cursor_execute", grab)
    statement, params = next(c for c in captured if c[0].lstrip().upper().startswith("SELECT"))
    with engine.connect() as conn:
        return " | ".join(row[-1] for row in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", params))


def test_indexes_serve_the_listing_order(tmp_path: object) -> None:
    from datetime import datetime, timezone

    from service.store.db import make_engine
    from service.store.migrate import upgrade

    engine = make_engine(f"sqlite:///{tmp_path}/plan.db")  # type: ignore[str-bytes-safe]
    upgrade(engine)  # the schema production has
    with engine.begin() as conn:
        conn.execute(text("ANALYZE"))
    cursor = (datetime(2030, 1, 1, tzinfo=timezone.utc), "jffff")
    for caller, kwargs in (
        (Caller(owner="ops", admin=True), {}),
        (Caller(owner="ops", admin=True), {"before": cursor}),
        (Caller(owner="alice", admin=False), {}),
        (Caller(owner="alice", admin=False), {"before": cursor}),
    ):
        plan = _plans(engine, caller, **kwargs)
        assert "TEMP B-TREE" not in plan, plan  # no sort: an index gives the order
        assert "ix_jobs_created_id" in plan or "ix_jobs_owner_created_id" in plan, plan
    engine.dispose()
