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
                                    "borrowing_limit": None, "accelerator_types": None}  # fmt: skip
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


def test_a_queue_limited_to_accelerator_types_refuses_other_jobs_at_submit(app_client) -> None:
    """Issue 37: `accelerator_types` set over the API round-trips, and a job of another type (or of none) is refused
    at submission with the field named; one of the queue's types is queued."""
    c = app_client()
    put = c.put("/v1/queues/a100", json={"accelerator_types": ["A100", "H100"]})
    assert put.status_code == 200 and put.json()["limits"]["accelerator_types"] == ["A100", "H100"], put.text
    assert c.put("/v1/queues/bad", json={"accelerator_types": ["A100; rm"]}).status_code == 422
    assert c.put("/v1/queues/bad", json={"accelerator_types": []}).status_code == 422

    def submit(resources: dict) -> object:
        return c.post("/v1/jobs", json={**GOOD, "queue": "a100", "resources": {"num_workers": 1, **resources}})

    assert submit({"accelerator_type": "H100"}).status_code == 201
    for resources in ({"accelerator_type": "T4"}, {}):
        refused = submit(resources)
        assert refused.status_code == 422 and refused.json()["field"] == "resources.accelerator_type", refused.text
        assert "queue 'a100' runs only A100, H100" in refused.json()["detail"]
    listed = {q["name"]: q for q in c.get("/v1/queues").json()}
    assert listed["a100"]["limits"]["accelerator_types"] == ["A100", "H100"]


def test_a_quota_by_accelerator_type_is_set_over_the_api_and_read_back(app_client) -> None:
    """Issue 37: a queue's per-owner quota may cap each accelerator type's GPUs; it reads back as written, and a bad
    cap is a 422 naming the field."""
    c = app_client()
    body = {"owner_quota": {"max_gpus": 16, "max_gpus_by_type": {"H100": 8, "T4": 0}}}
    put = c.put("/v1/queues/gpu", json=body)
    assert put.status_code == 200, put.text
    quota = next(q for q in c.get("/v1/queues").json() if q["name"] == "gpu")["limits"]["owner_quota"]
    assert quota["max_gpus_by_type"] == {"H100": 8, "T4": 0} and quota["max_gpus"] == 16
    for bad in ({"H100": -1}, {"H100": True}, {"H100": "8"}):
        refused = c.put("/v1/queues/gpu", json={"owner_quota": {"max_gpus_by_type": bad}})
        assert refused.status_code == 422 and "owner_quota.max_gpus_by_type" in refused.json()["field"], refused.text


def test_queue_limits_set_over_the_api_read_back_as_written(app_client) -> None:
    """Property: whatever limits a PUT accepts, GET /v1/queues answers them back the same (stored in the queue's row
    and read back through `queues.limits`)."""
    import itertools

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    c = app_client()
    names = (f"q{i}" for i in itertools.count())
    amount = st.none() | st.floats(min_value=0, max_value=1e9, allow_nan=False, allow_infinity=False)
    kind = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,20}", fullmatch=True)
    limits = st.fixed_dictionaries({
        "max_running": st.none() | st.integers(min_value=0, max_value=1_000_000),
        "max_cpus": amount, "max_gpus": amount, "preemption": st.booleans(),
        "cohort": st.none() | st.from_regex(r"[a-z0-9][a-z0-9_-]{0,20}", fullmatch=True),
        "accelerator_types": st.none() | st.lists(kind, min_size=1, max_size=4),
    })  # fmt: skip

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(limits)
    def round_trip(body: dict) -> None:
        name = next(names)
        assert c.put(f"/v1/queues/{name}", json=body).status_code == 200
        got = next(q for q in c.get("/v1/queues").json() if q["name"] == name)["limits"]
        assert {k: got[k] for k in body} == body

    round_trip()
