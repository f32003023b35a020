"""/v1/queues over the real app and a real SQLite file."""

from __future__ import annotations

from tests.api.conftest import GOOD, TOKENS


def test_queues_listed_created_and_enforced_at_submit(app_client) -> None:
    c = app_client()
    names = [q["name"] for q in c.get("/v1/queues").json()]
    assert "default" in names and "research" not in names
    refused = c.post("/v1/jobs", json={**GOOD, "queue": "research"})
    assert refused.status_code == 422 and refused.json()["field"] == "queue"
    put = c.put("/v1/queues/research", json={"max_running": 1, "max_gpus": 8, "preemption": True})
    assert put.status_code == 200, put.text
    assert put.json()["limits"] == {"max_running": 1, "max_cpus": None, "max_gpus": 8.0, "preemption": True,
                                    "owner_quota": None, "team_quota": None, "cohort": None,
                                    "borrowing_limit": None}  # fmt: skip
    assert c.post("/v1/jobs", json={**GOOD, "queue": "research"}).status_code == 201
    research = next(q for q in c.get("/v1/queues").json() if q["name"] == "research")
    assert research["queued"] == 1 and research["running"] == 0
    assert c.put("/v1/queues/research", json={"max_running": -1}).status_code == 422
    assert c.put("/v1/queues/Bad Name", json={}).status_code == 422


def test_only_admins_change_queues(app_client) -> None:
    alice = app_client("tok-alice", tokens=TOKENS)
    assert alice.get("/v1/queues").status_code == 200
    assert alice.put("/v1/queues/mine", json={"max_running": 5}).status_code == 403
    root = app_client("tok-root", tokens=TOKENS)
    assert root.put("/v1/queues/mine", json={"max_running": 5}).status_code == 200


def test_an_owner_sees_only_their_own_share_and_an_admin_sees_everyone(app_client) -> None:
    """Another owner's usage and share are theirs: the queue's totals are public, its per-owner lines are not."""
    alice, bob = app_client("tok-alice", tokens=TOKENS), app_client("tok-bob", tokens=TOKENS)
    root = app_client("tok-root", tokens=TOKENS)
    assert alice.post("/v1/jobs", json=GOOD).status_code == 201
    assert bob.post("/v1/jobs", json=GOOD).status_code == 201
    assert bob.post("/v1/jobs", json=GOOD).status_code == 201

    def default(client) -> dict:
        return next(q for q in client.get("/v1/queues").json() if q["name"] == "default")

    mine = default(alice)
    assert mine["queued"] == 3  # the queue's own totals count everyone
    assert [(o["owner"], o["queued"]) for o in mine["owners"]] == [("alice", 1)]
    assert [(o["owner"], o["queued"]) for o in default(bob)["owners"]] == [("bob", 2)]
    assert sorted((o["owner"], o["queued"]) for o in default(root)["owners"]) == [("alice", 1), ("bob", 2)]
