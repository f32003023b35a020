"""Issue 37 end to end: a queue that makes a real Ray autoscaler grow the cluster, and lets it shrink.

A head with no CPUs runs Ray's real autoscaler (v1 monitor) with Ray's fake node provider (tests/autoscaling.py): two
node types, `cpu1` (1 CPU, up to 2) and `t4` (1 CPU and the resource `accelerator_type:T4`, up to 1). A real
`shunter serve` runs against it with nothing but `SHUNTER_CLUSTER_MAY_GROW=true` and `SHUNTER_NODE_TYPES` set, and
real jobs train a tiny MLP on it (gloo, CPU). One test, one Ray start-up: the scenarios share the cluster.

The demand itself (what is asked, in which order, fair share first) is table-tested in tests/service/test_demand.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from tests.autoscaling import autoscaling_head
from tests.conftest import wait_for
from tests.external_ray import serve_against
from tests.service.test_e2e_serve import mlp_spec

pytestmark = pytest.mark.slow

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


def test_the_queue_grows_the_cluster_places_typed_work_and_lets_idle_nodes_go(tmp_path: Path) -> None:
    with autoscaling_head(NODE_TYPES) as head:
        svc = serve_against(head, tmp_path, SHUNTER_CLUSTER_MAY_GROW="true",
                            SHUNTER_NODE_TYPES=json.dumps(NODE_TYPES))  # fmt: skip
        try:
            c = svc.client()
            http = httpx.Client(base_url=svc.url, timeout=30)
            assert worker_nodes(http.get("/v1/cluster").json()) == []  # the head alone: no room for any worker
            # No node type could hold it: refused at submission, naming the field.
            refused = http.post("/v1/jobs", json=mlp_spec() | {"resources": {"num_workers": 2, "accelerator_type":
                                                                             "T4"}})  # fmt: skip
            assert refused.status_code == 422 and refused.json()["field"] == "resources", refused.text
            typed = c.submit(
                mlp_spec(total_steps=8) | {"name": "on-t4", "resources": {"num_workers": 1, "accelerator_type": "T4"}}
            )
            plain = c.submit(mlp_spec(total_steps=8) | {"name": "plain"})  # 2 workers of 1 CPU
            asked = wait_for(lambda: http.get("/v1/cluster").json().get("scale_request"), timeout=60,
                             what="the dispatcher's request to the autoscaler")  # fmt: skip
            assert asked["jobs"] >= 1 and asked["bundles"], asked
            waiting = c.get(plain.id)
            assert waiting.state != "QUEUED" or "asked the autoscaler" in (waiting.state_reason or "")
            for job in (typed, plain):
                done = c.wait(job.id, timeout=300)
                assert done.state == "SUCCEEDED", (done.state, done.last_error, svc.log_path.read_text()[-3000:])
                reasons = [e.reason for e in c.events(job.id) if e.kind == "scale"]
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
        finally:
            svc.stop()
