"""Tokens and ownership over the real app and a real SQLite file: a user sees and acts on their own jobs only.

Another owner's job answers 404, exactly like a job that does not exist: a 403 would confirm that the id is real.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from fastapi.testclient import TestClient

from tests.api.conftest import GOOD, TOKENS

Make = Callable[..., TestClient]


@pytest.fixture
def clients(app_client: Make) -> dict[str, TestClient]:
    return {name: app_client(tok, tokens=TOKENS) for name, tok in
            (("alice", "tok-alice"), ("bob", "tok-bob"), ("root", "tok-root"), ("nobody", None))}  # fmt: skip


def test_owner_only_and_admin_sees_all(clients: dict[str, TestClient]) -> None:
    alice, bob, root = clients["alice"], clients["bob"], clients["root"]
    job = alice.post("/v1/jobs", json={**GOOD, "name": "a1"}).json()
    assert job["owner"] == "alice"
    bob_job = bob.post("/v1/jobs", json={**GOOD, "name": "b1"}).json()

    for path in ("", "/events", "/attempts", "/checkpoints", "/metrics", "/logs", "/events?follow=true"):
        r = bob.get(f"/v1/jobs/{job['id']}{path}")
        assert r.status_code == 404, (path, r.text)
        assert r.json() == bob.get(f"/v1/jobs/jnonexistent{path}").json() | {"detail": f"no job '{job['id']}'"}
    for action in ("cancel", "retry"):
        assert bob.post(f"/v1/jobs/{job['id']}/{action}").status_code == 404
    assert [j["id"] for j in bob.get("/v1/jobs").json()["items"]] == [bob_job["id"]]
    assert bob.get("/v1/jobs", params={"owner": "alice"}).json()["items"] == []  # cannot widen to another owner
    assert {e["job_id"] for e in bob.get("/v1/events").json()} == {bob_job["id"]}
    assert bob.get("/v1/cluster").status_code == 200

    assert root.get(f"/v1/jobs/{job['id']}").json()["owner"] == "alice"
    assert {j["id"] for j in root.get("/v1/jobs").json()["items"]} == {job["id"], bob_job["id"]}
    assert [j["id"] for j in root.get("/v1/jobs", params={"owner": "alice"}).json()["items"]] == [job["id"]]
    assert {e["job_id"] for e in root.get("/v1/events").json()} == {job["id"], bob_job["id"]}
    # The owner can act; the event names who did.
    assert alice.post(f"/v1/jobs/{job['id']}/cancel").status_code == 202
    assert alice.get(f"/v1/jobs/{job['id']}/events").json()[-1]["actor"] == "alice"
    assert root.post(f"/v1/jobs/{bob_job['id']}/cancel").status_code == 202


def test_no_or_bad_token_is_401_and_health_is_open(clients: dict[str, TestClient], app_client: Make) -> None:
    nobody = clients["nobody"]
    for method, path in (("GET", "/v1/jobs"), ("POST", "/v1/jobs"), ("GET", "/v1/jobs/jx"), ("GET", "/v1/events"),
                         ("GET", "/v1/cluster"), ("GET", "/metrics"), ("POST", "/v1/jobs/jx/cancel")):  # fmt: skip
        r = nobody.request(method, path, json=GOOD if method == "POST" else None)
        assert r.status_code == 401 and r.json()["code"] == "unauthorized", (path, r.text)
    wrong = app_client("tok-alicf", tokens=TOKENS)
    assert wrong.get("/v1/jobs").status_code == 401
    basic = app_client(None, tokens=TOKENS)
    assert basic.get("/v1/jobs", headers={"Authorization": "Basic dG9rLWFsaWNl"}).status_code == 401
    assert nobody.get("/healthz").status_code == 200
    assert nobody.get("/readyz").status_code == 503  # open, and honest: Ray is at a closed port here
    assert nobody.get("/openapi.json").status_code == 200


def test_idempotency_keys_are_per_owner(clients: dict[str, TestClient]) -> None:
    alice, bob = clients["alice"], clients["bob"]
    key = {"Idempotency-Key": "k-1"}
    first = alice.post("/v1/jobs", json=GOOD, headers=key)
    again = alice.post("/v1/jobs", json=GOOD, headers=key)
    assert (first.status_code, again.status_code) == (201, 200) and first.json()["id"] == again.json()["id"]
    other = alice.post("/v1/jobs", json={**GOOD, "name": "other"}, headers=key)
    assert other.status_code == 409 and other.json()["code"] == "conflict"
    # The same key from another owner is another job, and does not reveal alice's.
    bobs = bob.post("/v1/jobs", json=GOOD, headers=key)
    assert bobs.status_code == 201 and bobs.json()["id"] != first.json()["id"]
