"""Token policy (issue 12): one strict schema for what a token grants, and the submit limits it carries.

`SHUNTER_API_TOKENS='{"t": {"owner": "a", "admin": "false"}}'` made an admin (`bool("false")` is true): now every
token entry is a strict `TokenInfo`, refused at start-up when it does not parse. A non-admin token may limit the
queues its owner submits to and the highest priority it asks for (403 `forbidden`, naming `queue` / `priority`), on
submit and on retry; admins, and everyone in single-user local mode (no tokens), are unrestricted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from sqlalchemy.engine import Engine

from api.app import create_app
from service.config.settings import Settings
from service.config.tokens import TokenInfo
from service.core.errors import Forbidden
from service.lifecycle import jobs
from service.runtime import Runtime
from service.spec.job import JobSpec
from service.store.db import session_scope
from service.store.models import JobState
from service.tenancy.auth import Caller
from tests.api.conftest import GOOD, offline_settings

ROOT = Path(__file__).resolve().parents[2]


# ---- the schema ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("entry", "field"),
    [
        ({"owner": "a", "admin": "false"}, "admin"),  # the issue: a string is not a boolean
        ({"owner": "a", "admin": "true"}, "admin"),
        ({"owner": "a", "admin": 1}, "admin"),
        ({"owner": "a", "admin": None}, "admin"),
        ({"admin": True}, "owner"),
        ({"owner": ""}, "owner"),
        ({"owner": "alice\n"}, "owner"),  # fullmatch: no trailing newline
        ({"owner": "al ice"}, "owner"),
        ({"owner": 7}, "owner"),
        ({"owner": "a", "role": "admin"}, "role"),  # an unknown key is an error, not a grant silently ignored
        ({"owner": "a", "team": "ml team"}, "team"),
        ({"owner": "a", "queues": "research"}, "queues"),
        ({"owner": "a", "queues": ["Research"]}, "queues"),
        ({"owner": "a", "queues": ["research\n"]}, "queues"),
        ({"owner": "a", "max_priority": "5"}, "max_priority"),
        ({"owner": "a", "max_priority": 5.0}, "max_priority"),
        ({"owner": "a", "max_priority": 5000}, "max_priority"),
    ],
)
def test_a_token_entry_that_does_not_parse_is_refused(entry: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as err:
        TokenInfo.model_validate(entry)
    assert [e["loc"][0] for e in err.value.errors()] == [field], err.value.errors()


def test_a_full_token_entry_parses() -> None:
    info = TokenInfo.model_validate(
        {"owner": "alice@example.com", "admin": False, "team": "ml", "queues": ["research"], "max_priority": 10}
    )
    assert (info.owner, info.admin, info.team, info.queues, info.max_priority) == (
        "alice@example.com", False, "ml", ["research"], 10
    )  # fmt: skip
    assert TokenInfo.model_validate({"owner": "bob"}) == TokenInfo(owner="bob", admin=False)


@pytest.mark.parametrize(
    "tokens",
    [
        '{"t": {"owner": "a", "admin": "false"}}',
        '{"t": {"owner": "a", "admin": 0}}',
        '{"t": {"admin": true}}',
        '{"t": {"owner": "a", "is_admin": true}}',
        '{"": {"owner": "a"}}',
        '{"t": "a"}',
        "not json",
    ],
)
def test_bad_tokens_in_the_environment_refuse_the_settings(monkeypatch: pytest.MonkeyPatch, tokens: str) -> None:
    monkeypatch.setenv("SHUNTER_API_TOKENS", tokens)
    with pytest.raises(ValidationError) as err:
        Settings(_env_file=None)
    assert all(e["loc"][0] == "api_tokens" for e in err.value.errors()), err.value.errors()


def test_good_tokens_in_the_environment_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHUNTER_API_TOKENS", '{"t": {"owner": "a", "admin": false, "queues": ["q1"]}}')
    assert Settings(_env_file=None).api_tokens == {"t": TokenInfo(owner="a", queues=["q1"])}


def test_the_service_refuses_to_start_with_a_string_admin(tmp_path: Path) -> None:
    """`shunter api` exits at start-up, naming the entry, instead of serving with an admin nobody meant."""
    env = {
        **os.environ,
        "SHUNTER_API_TOKENS": '{"t": {"owner": "a", "admin": "false"}}',
        "SHUNTER_DATABASE_URL": f"sqlite:///{tmp_path / 'x.db'}",
        "SHUNTER_DATA_DIR": str(tmp_path / "data"),
        "SHUNTER_RAY_ADDRESS": "127.0.0.1:9",
    }
    result = subprocess.run(
        [sys.executable, "-m", "api.cli", "api", "--port", "1"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "api_tokens.t.admin" in output and "valid boolean" in output, output[-2000:]


# ---- the policy, in the service (SQLite and PostgreSQL) ------------------------------------------------------------
ALICE = Caller(owner="alice", admin=False, queues=("research",), max_priority=10)
ROOT_CALLER = Caller(owner="ops", admin=True, queues=("research",), max_priority=0)  # admins are never limited


def submit(db: Engine, caller: Caller, **spec: Any) -> str:
    with session_scope(db) as session:
        job, _ = jobs.submit(session, JobSpec.model_validate({**GOOD, **spec}), caller=caller)
        return job.id


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"queue": "default"}, "queue"),
        ({"queue": "other"}, "queue"),
        ({"queue": "research", "priority": 11}, "priority"),
        ({"queue": "research", "priority": 1000}, "priority"),
    ],
)
def test_a_non_admin_submits_only_within_its_token(db: Engine, spec: dict[str, Any], field: str) -> None:
    with pytest.raises(Forbidden) as err:
        submit(db, ALICE, **spec)
    assert err.value.field == field and err.value.to_body()["code"] == "forbidden"
    assert field in err.value.detail


def test_within_its_token_and_as_admin_it_submits(db: Engine) -> None:
    assert submit(db, ALICE, queue="research", priority=10)
    assert submit(db, ALICE, queue="research", priority=-5)
    assert submit(db, ROOT_CALLER, queue="default", priority=1000)
    assert submit(db, Caller("alice", admin=False), queue="default", priority=1000)  # no limits in the token
    assert submit(db, Caller(), queue="other", priority=1000)  # local mode: the anonymous admin


def test_retry_is_held_to_the_same_limits(db: Engine) -> None:
    """A job queued while the token allowed more (or by an admin for the owner) is not requeued past the token."""
    wide = Caller(owner="alice", admin=False)
    job_id = submit(db, wide, queue="default", priority=50)
    with session_scope(db) as session:
        jobs.cancel(session, job_id, caller=wide)
    for narrowed, field in ((ALICE, "queue"), (Caller("alice", admin=False, max_priority=49), "priority")):
        with session_scope(db) as session, pytest.raises(Forbidden) as err:
            jobs.retry(session, job_id, caller=narrowed)
        assert err.value.field == field
    with session_scope(db) as session:
        assert jobs.retry(session, job_id, caller=Caller("alice", admin=False, max_priority=50)).state == (
            JobState.QUEUED
        )


# ---- the policy, over HTTP -------------------------------------------------------------------------------------
TOKENS = {
    "tok-alice": {"owner": "alice", "team": "ml", "queues": ["q1"], "max_priority": 10},
    "tok-root": {"owner": "ops", "admin": True},
}


@pytest.fixture
def http(tmp_path: Path) -> Iterator[dict[str, TestClient]]:
    runtime = Runtime.open(offline_settings(tmp_path, api_tokens=TOKENS))
    clients = {
        name: TestClient(create_app(runtime=runtime), raise_server_exceptions=False,
                         headers={"Authorization": f"Bearer {token}"})
        for name, token in (("alice", "tok-alice"), ("root", "tok-root"))
    }  # fmt: skip
    for c in clients.values():
        c.__enter__()
    yield clients
    for c in clients.values():
        c.__exit__(None, None, None)
    runtime.close()


def test_the_token_limits_hold_over_http(http: dict[str, TestClient]) -> None:
    alice, root = http["alice"], http["root"]
    for spec, field in (({"queue": "default"}, "queue"), ({"queue": "q1", "priority": 11}, "priority")):
        r = alice.post("/v1/jobs", json={**GOOD, **spec})
        assert r.status_code == 403, r.text
        assert r.json()["code"] == "forbidden" and r.json()["field"] == field
    ok = alice.post("/v1/jobs", json={**GOOD, "queue": "q1", "priority": 10})
    assert ok.status_code == 201 and ok.json()["owner"] == "alice"
    assert root.post("/v1/jobs", json={**GOOD, "queue": "default", "priority": 1000}).status_code == 201
    # What alice may not do stays undone: nothing of hers outside q1.
    assert {j["queue"] for j in root.get("/v1/jobs", params={"owner": "alice"}).json()["items"]} == {"q1"}


def test_without_tokens_the_local_caller_is_an_unlimited_admin(tmp_path: Path) -> None:
    runtime = Runtime.open(offline_settings(tmp_path))
    try:
        with TestClient(create_app(runtime=runtime)) as c:
            r = c.post("/v1/jobs", json={**GOOD, "queue": "gpu", "priority": 1000})
            assert r.status_code == 201 and r.json()["owner"] == "anonymous"
            assert c.put("/v1/queues/extra", json={"max_running": 1}).status_code == 200
    finally:
        runtime.close()
