"""`position` and `estimated_start` of queued jobs over the real app and a real SQLite file, in fair-share order."""

from __future__ import annotations

from datetime import datetime

from sqlmodel import Session

from service.store.models import ClusterSnapshot, utcnow
from tests.api.conftest import TOKENS

CPU = "CPU"


def test_position_and_estimate_follow_fair_share(app_client) -> None:
    """alice queues three 2-CPU jobs, then bob one, on a 2-CPU cluster with nothing running: fair share puts bob's
    second (alice has no usage yet either, but each of her placed jobs counts as projected use); every job says its
    place, and with timeouts the estimate is the replayed schedule."""
    alice, bob = app_client("tok-alice", tokens=TOKENS), app_client("tok-bob", tokens=TOKENS)
    runtime = alice.app.state.runtime
    with Session(runtime.engine) as session:
        session.merge(ClusterSnapshot(id=1, total={CPU: 2.0}, available={CPU: 2.0},
                                      nodes=[{"node_id": "n", "alive": True, "total": {CPU: 2.0}}]))  # fmt: skip
        session.commit()
    spec = {"entrypoint": {"callable": "examples.mlp:train_loop"}, "resources": {"num_workers": 2},
            "timeout_seconds": 600}  # fmt: skip
    ids = [alice.post("/v1/jobs", json=spec).json()["id"] for _ in range(3)]
    ids.append(bob.post("/v1/jobs", json=spec).json()["id"])
    views = [(alice if i < 3 else bob).get(f"/v1/jobs/{job}").json() for i, job in enumerate(ids)]
    overall = [v["position"]["overall"] for v in views]
    assert overall == [1, 3, 4, 2], overall  # bob's job second
    assert all(v["position"]["queue"] == v["position"]["overall"] for v in views)
    now = utcnow()
    starts = [v["estimated_start"] for v in views]
    assert all(s is not None for s in starts)
    waits = [(datetime.fromisoformat(s) - now).total_seconds() for s in starts]
    for wait, expected in zip(waits, [0, 1200, 1800, 600], strict=True):
        assert abs(wait - expected) < 30, waits
    # The listing gives each queued job the same place (the web page's queue view reads it there), and a job that
    # has left the queue none: only queued jobs stand anywhere.
    listed = {j["id"]: j["position"] for j in alice.get("/v1/jobs?positions=true").json()["items"]}
    assert listed == {job: v["position"] for job, v in zip(ids[:3], views[:3], strict=True)}
    # Asked for only: a plain listing never pays for the whole queue's forecast.
    assert {j["position"] for j in alice.get("/v1/jobs").json()["items"]} == {None}
    assert alice.post(f"/v1/jobs/{ids[0]}/cancel").status_code == 202
    after = alice.get("/v1/jobs?positions=true").json()["items"]
    assert next(j for j in after if j["id"] == ids[0])["position"] is None


def test_a_job_behind_one_without_a_timeout_has_no_estimate(app_client) -> None:
    c = app_client()
    runtime = c.app.state.runtime
    with Session(runtime.engine) as session:
        session.merge(ClusterSnapshot(id=1, total={CPU: 2.0}, available={CPU: 2.0},
                                      nodes=[{"node_id": "n", "alive": True, "total": {CPU: 2.0}}]))  # fmt: skip
        session.commit()
    first = c.post("/v1/jobs", json={"entrypoint": {"callable": "examples.mlp:train_loop"},
                                     "resources": {"num_workers": 2}}).json()["id"]  # fmt: skip
    second = c.post("/v1/jobs", json={"entrypoint": {"callable": "examples.mlp:train_loop"},
                                      "resources": {"num_workers": 2}, "timeout_seconds": 60}).json()["id"]  # fmt: skip
    assert c.get(f"/v1/jobs/{first}").json()["estimated_start"] is not None
    behind = c.get(f"/v1/jobs/{second}").json()
    assert behind["position"] == {"queue": 2, "overall": 2} and behind["estimated_start"] is None
