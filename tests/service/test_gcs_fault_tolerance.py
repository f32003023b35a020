"""Issue 13, item 3: Ray's GCS fault tolerance (the GCS keeps its state in an external Redis, as KubeRay's
`gcsFaultToleranceOptions` sets up). A head killed and started again is then the same cluster: Ray's job table and
the worker nodes survive, and so do the jobs whose drivers ran off the head.

- With `SHUNTER_RAY_DRIVERS_OFF_HEAD=true`, running jobs outlive the head restart: shunter keeps watching the same
  Ray Jobs, never resubmits, and each job ends on its first attempt with no step run twice.
- Without it (Ray's default: drivers on the head), the drivers die with the head while Ray goes on reporting their
  jobs RUNNING until its job manager notices (then FAILED, which would read as an infra failure). shunter sees the
  driver's node dead at once, ends the attempt as `cluster_restarted` and resumes the job from its checkpoint.

A real cluster on this machine: a fault-tolerant head (0 CPUs, as a KubeRay head is usually set up) and one worker
node with 3 CPUs, both `ray start --block` processes; the machine's Redis on 127.0.0.1:6379.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import wait_for
from tests.external_ray import ExternalHead, WorkerNode, redis_answers, serve_against

pytestmark = pytest.mark.slow
SPEC = {
    "entrypoint": {"callable": "examples.mlp:train_loop"}, "resources": {"num_workers": 1},
    "config": {"total_steps": 60, "checkpoint_every": 10, "report_every": 1, "step_sleep": 0.15},
    "retries": {"max_attempts": 1, "backoff_seconds": 1},
}  # fmt: skip


def alive_nodes(head: ExternalHead) -> int:
    try:
        r = httpx.get(f"{head.dashboard_url}/nodes", params={"view": "summary"}, timeout=5)
        return sum(n["raylet"].get("state") == "ALIVE" for n in r.json()["data"]["summary"])
    except (httpx.HTTPError, ValueError, KeyError):
        return 0


def head_node_id(head: ExternalHead) -> str:
    r = httpx.get(f"{head.dashboard_url}/nodes", params={"view": "summary"}, timeout=5)
    (node,) = [n["raylet"]["nodeId"] for n in r.json()["data"]["summary"]
               if n["raylet"].get("isHeadNode") and n["raylet"].get("state") == "ALIVE"]  # fmt: skip
    return str(node)


@pytest.fixture(scope="module")
def cluster() -> Iterator[ExternalHead]:
    assert redis_answers(), "these tests need the Redis server on 127.0.0.1:6379 (.ci/run starts it)"
    head = ExternalHead(num_cpus=0, fault_tolerant=True)
    head.start()
    worker = WorkerNode(head, num_cpus=3)
    worker.start()
    try:
        wait_for(lambda: alive_nodes(head) == 2, timeout=90, what="the worker node to join")
        yield head
    finally:
        worker.kill()
        head.kill()
        head.forget()


def restart_head_after_checkpoints(http: httpx.Client, head: ExternalHead, ids: list[str]) -> None:
    def checkpointed() -> bool:
        return all(len(http.get(f"/v1/jobs/{i}/checkpoints").json()) >= 1 for i in ids)

    wait_for(checkpointed, timeout=240, what="every job past its first checkpoint")
    head.kill()
    wait_for(lambda: http.get("/readyz").status_code == 503, timeout=30, what="/readyz to say Ray is not ready")
    time.sleep(2)
    head.start()
    wait_for(lambda: http.get("/readyz").status_code == 200, timeout=90, what="/readyz ready again")


def wait_ended(http: httpx.Client, ids: list[str]) -> list[dict[str, Any]]:
    def ended() -> bool:
        return all(http.get(f"/v1/jobs/{i}").json()["state"] in ("SUCCEEDED", "FAILED", "CANCELLED") for i in ids)

    wait_for(ended, timeout=400, interval=1.0, what="every job to end")
    return [http.get(f"/v1/jobs/{i}").json() for i in ids]


def ray_job(head: ExternalHead, submission_id: str) -> dict[str, Any]:
    return dict(httpx.get(f"{head.dashboard_url}/api/jobs/{submission_id}", timeout=10).json())


def test_jobs_with_drivers_off_the_head_outlive_a_head_restart(tmp_path: Path, cluster: ExternalHead) -> None:
    svc = serve_against(cluster, tmp_path, SHUNTER_RAY_DRIVERS_OFF_HEAD="true")
    try:
        http = httpx.Client(base_url=svc.url, timeout=30)
        posted = [http.post("/v1/jobs", json=SPEC) for _ in range(2)]
        assert all(r.status_code == 201 for r in posted), [r.text for r in posted]
        ids = [r.json()["id"] for r in posted]
        wait_for(lambda: all(http.get(f"/v1/jobs/{i}").json()["state"] == "RUNNING" for i in ids), timeout=120,
                 what="both jobs RUNNING")  # fmt: skip
        drivers = {ray_job(cluster, f"shunter-{i}-1")["driver_node_id"] for i in ids}
        assert None not in drivers and head_node_id(cluster) not in drivers, drivers  # placed off the head
        restart_head_after_checkpoints(http, cluster, ids)
        for job in wait_ended(http, ids):
            # The same Ray Job ran to the end: one attempt, one submission, every step once.
            why = (job["end_reason"], (job["last_error"] or "")[-4000:])
            assert (job["state"], job["step"], job["attempt"]) == ("SUCCEEDED", 60, 1), why
            events = http.get(f"/v1/jobs/{job['id']}/events").json()
            assert [e["reason"] for e in events].count("ray_job_submitted") == 1, events
            metrics = http.get(f"/v1/jobs/{job['id']}/metrics", params={"name": "loss"}).json()
            steps = Counter(m["step"] for m in metrics)
            assert sorted(steps) == list(range(1, 61)) and set(steps.values()) == {1}, steps
            # The job ended on its driver's word; Ray's own end of the Ray Job follows once the driver has exited.
            sub_id = f"shunter-{job['id']}-1"
            wait_for(lambda s=sub_id: ray_job(cluster, s)["status"] in ("SUCCEEDED", "FAILED", "STOPPED"), timeout=120,
                     what="Ray's end of the Ray Job")  # fmt: skip
            ray = ray_job(cluster, sub_id)
            assert ray["status"] == "SUCCEEDED", ray
        ray_ids = httpx.get(f"{cluster.dashboard_url}/api/jobs/", timeout=10).json()
        assert sorted(j["submission_id"] for j in ray_ids if j["submission_id"].startswith("shunter-")) == sorted(
            f"shunter-{i}-1" for i in ids
        )
    finally:
        svc.stop()


def test_a_job_whose_driver_died_with_the_head_is_resumed_not_left_running(
    tmp_path: Path, cluster: ExternalHead
) -> None:
    svc = serve_against(cluster, tmp_path)  # Ray's default placement: the driver on the head
    try:
        http = httpx.Client(base_url=svc.url, timeout=30)
        job_id = http.post("/v1/jobs", json=SPEC).json()["id"]
        wait_for(lambda: http.get(f"/v1/jobs/{job_id}").json()["state"] == "RUNNING", timeout=120, what="RUNNING")
        assert ray_job(cluster, f"shunter-{job_id}-1")["driver_node_id"] == head_node_id(cluster)
        restart_head_after_checkpoints(http, cluster, [job_id])
        (job,) = wait_ended(http, [job_id])
        assert (job["state"], job["step"]) == ("SUCCEEDED", 60), job
        first, *later = http.get(f"/v1/jobs/{job_id}/attempts").json()
        # Ended by shunter's node check, not by Ray's late FAILED (which would read as an infra failure and, with
        # max_attempts=1, fail the job).
        assert first["end_reason"] == "cluster_restarted" and "driver's node" in first["message"], first
        assert later and later[-1]["end_reason"] == "succeeded", later
        # Resumed from the first attempt's last checkpoint.
        metrics = http.get(f"/v1/jobs/{job_id}/metrics", params={"name": "loss"}).json()
        resumed_at = min(m["step"] for m in metrics if m["attempt"] == job["attempt"])
        saved = {c["step"] for c in http.get(f"/v1/jobs/{job_id}/checkpoints").json() if c["attempt"] == 1}
        assert resumed_at - 1 in saved and resumed_at > 1, (resumed_at, saved)
    finally:
        svc.stop()
