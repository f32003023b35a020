"""Issue 37 end to end: a queue that makes a real Ray autoscaler grow the cluster, and lets it shrink.

A head with no CPUs runs Ray's real autoscaler (v1 monitor) with Ray's fake node provider (tests/autoscaling.py): two
node types, `cpu1` (1 CPU, up to 2) and `t4` (1 CPU and the resource `accelerator_type:T4`, up to 1). A real
`shunter serve` runs against it with `SHUNTER_CLUSTER_MAY_GROW=true` and `SHUNTER_NODE_TYPES` set, and real jobs train
a tiny MLP on it (gloo, CPU). Two owners need API tokens (without them every caller is one anonymous admin), and
`SHUNTER_SCALE_MAX_PENDING_JOBS=1` makes the request hold one waiting gang at a time, so its order shows. One test,
one Ray start-up: the scenarios share the cluster.

The demand itself (what is asked, in which order, fair share first) is table-tested in tests/service/test_demand.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from api.client import Client
from tests.autoscaling import autoscaling_head
from tests.conftest import wait_for
from tests.external_ray import serve_against
from tests.service.test_e2e_serve import mlp_spec

pytestmark = pytest.mark.slow

TOKENS = {"tok-alice": {"owner": "alice"}, "tok-bob": {"owner": "bob"}, "tok-admin": {"owner": "ops", "admin": True}}
NODE_TYPES = {
    "cpu1": {"resources": {"CPU": 1}, "max": 2},
    "t4": {"resources": {"CPU": 1, "accelerator_type:T4": 1}, "max": 1},
}


def worker_nodes(cluster: dict) -> list[dict]:
    """The live nodes that hold CPUs (the head holds none)."""
    return [n for n in cluster["nodes"] if n.get("alive", True) and n["total"].get("CPU", 0) > 0]


def typed_nodes(dashboard_url: str, submission_id: str) -> list[dict[str, float]]:
    """The total resources of each node a Ray Job's train workers ran on (ended workers and released nodes too)."""
    from ray.util.state import list_actors, list_nodes

    ray_job_id = httpx.get(f"{dashboard_url}/api/jobs/{submission_id}", timeout=10).json()["job_id"]
    actors = list_actors(address=dashboard_url, limit=1000)
    ids = {a.node_id for a in actors if a.job_id == ray_job_id and "RayTrainWorker" in (a.class_name or "")}
    nodes = {n.node_id: n for n in list_nodes(address=dashboard_url, limit=1000, detail=True)}
    return [dict(nodes[i].resources_total) for i in ids if i in nodes]


def http_events(http: httpx.Client, job_id: str) -> list[dict]:
    r = http.get(f"/v1/jobs/{job_id}/events")
    r.raise_for_status()
    return list(r.json())


def test_the_queue_grows_the_cluster_places_typed_work_and_lets_idle_nodes_go(tmp_path: Path) -> None:
    with autoscaling_head(NODE_TYPES) as head:
        svc = serve_against(head, tmp_path, SHUNTER_CLUSTER_MAY_GROW="true", SHUNTER_NODE_TYPES=json.dumps(NODE_TYPES),
                            SHUNTER_API_TOKENS=json.dumps(TOKENS), SHUNTER_SCALE_MAX_PENDING_JOBS="1")  # fmt: skip
        try:
            c, bob = Client(svc.url, token="tok-alice"), Client(svc.url, token="tok-bob")
            http = httpx.Client(base_url=svc.url, timeout=30, headers={"Authorization": "Bearer tok-admin"})
            assert worker_nodes(http.get("/v1/cluster").json()) == []  # the head alone: no room for any worker
            # No node type could hold it: refused at submission, naming the field.
            refused = http.post("/v1/jobs", json=mlp_spec() | {"resources": {"num_workers": 2, "accelerator_type":
                                                                             "T4"}})  # fmt: skip
            assert refused.status_code == 422 and refused.json()["field"] == "resources", refused.text
            typed = c.submit(
                mlp_spec(total_steps=8) | {"name": "on-t4", "resources": {"num_workers": 1, "accelerator_type": "T4"}}
            )
            plain = bob.submit(mlp_spec(total_steps=8) | {"name": "plain"})  # 2 workers of 1 CPU: bob uses more
            asked = wait_for(lambda: http.get("/v1/cluster").json().get("scale_request"), timeout=60,
                             what="the dispatcher's request to the autoscaler")  # fmt: skip
            assert asked["jobs"] >= 1 and asked["bundles"], asked
            waiting = c.get(typed.id)  # the first in the order: the one gang the request holds
            assert waiting.state != "QUEUED" or "asked the autoscaler" in (waiting.state_reason or "")
            for client, job in ((c, typed), (bob, plain)):
                done = client.wait(job.id, timeout=300)
                assert done.state == "SUCCEEDED", (done.state, done.last_error, svc.log_path.read_text()[-3000:])
                reasons = [e["reason"] for e in http_events(http, job.id) if e["kind"] == "scale"]
                assert reasons == ["scale_requested", "capacity_arrived"], reasons
            # The typed job's worker ran on the node type that carries accelerator_type:T4 (asked of Ray's state
            # API, which keeps ended actors and released nodes).
            sub = c.get(typed.id).ray_submission_id
            assert sub is not None
            ran_on = typed_nodes(head.dashboard_url, sub)
            assert ran_on and all("accelerator_type:T4" in res for res in ran_on), ran_on
            # Nothing waits: the request is withdrawn and the idle nodes go (idle timeout 6 s), back to the head.
            wait_for(lambda: http.get("/v1/cluster").json().get("scale_request") is None, timeout=30,
                     what="the request withdrawn")  # fmt: skip
            started = time.monotonic()
            wait_for(lambda: worker_nodes(http.get("/v1/cluster").json()) == [], timeout=120,
                     what="the autoscaler to release the idle nodes")  # fmt: skip
            print(f"idle nodes released {time.monotonic() - started:.0f} s after the request was withdrawn")
            # Fair share decides whose gang is asked for first: bob's job is queued first, but bob used more than
            # alice did (2 workers to her 1), so the one gang the request holds is alice's; bob's comes after it.
            used = {r["owner"]: r["cpu_hours"] for r in http.get("/v1/usage").json()["rows"]}
            assert used["bob"] > used["alice"] > 0, used  # the premise, as the service counts it
            # Both are queued before any pass may ask for either: their queue admits nothing until both are in (a
            # pass between the two posts would rightly ask for bob's, the only one waiting then).
            assert http.put("/v1/queues/later", json={"max_running": 0}).status_code == 200
            bob_next = bob.submit(mlp_spec(total_steps=8) | {"name": "bob-next", "queue": "later"})
            alice_next = c.submit(mlp_spec(total_steps=8) | {"name": "alice-next", "queue": "later"})
            assert http.put("/v1/queues/later", json={}).status_code == 200  # no limit: both now wait for room

            def asked_for(job_id: str) -> list[int]:
                return [e["id"] for e in http_events(http, job_id) if e["reason"] == "scale_requested"]

            first = wait_for(lambda: asked_for(alice_next.id) or asked_for(bob_next.id), timeout=60,
                             what="a scale request for one of the two gangs")  # fmt: skip
            assert first == asked_for(alice_next.id), "bob's gang was asked for first, against fair share"
            assert all(later > first[0] for later in asked_for(bob_next.id))
            c.cancel(alice_next.id)
            bob.cancel(bob_next.id)
        finally:
            svc.stop()
