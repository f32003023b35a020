"""Issue 13, item 3: Ray's GCS fault tolerance (the GCS keeps its state in an external Redis, as KubeRay's
`gcsFaultToleranceOptions` sets up). A head killed and started again is then the same cluster: Ray's job table and
the worker nodes survive, and so do the jobs whose drivers ran off the head.

- With `SHUNTER_RAY_DRIVERS_OFF_HEAD=true`, running jobs outlive the head restart: shunter keeps watching the same
  Ray Jobs, never resubmits, and each job ends on its first attempt with no step run twice.
- Without it (Ray's default: drivers on the head), the drivers die with the head while Ray goes on reporting their
  jobs RUNNING until its job manager notices (then FAILED, which would read as an infra failure). shunter sees the
  driver's node dead at once, ends the attempt as `cluster_restarted` and resumes the job from its checkpoint.

A real cluster on this machine: a fault-tolerant head (0 CPUs, as a KubeRay head is usually set up) and one worker
node with 3 CPUs, both `ray start --block` processes; the machine's Redis on 127.0.0.1:6379. Both cases share one
head restart (the `restarted` fixture): a service of each kind, their three jobs running across it.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
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


@dataclass
class Restarted:
    """Both services' jobs on the cluster, across one head restart: facts taken before it, and the jobs' ends after."""

    off: httpx.Client  # the service with SHUNTER_RAY_DRIVERS_OFF_HEAD=true
    on: httpx.Client  # Ray's default placement: drivers on the head
    off_ids: list[str]
    on_id: str
    drivers_off: set[str | None]  # the nodes the off-head jobs' drivers ran on
    driver_on: str | None  # ... and the on-head job's
    head_before: str  # the head's node id before the restart


@pytest.fixture(scope="module")
def restarted(cluster: ExternalHead, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Restarted]:
    """One head restart for both tests (each restart costs a head start and the jobs' new attempts): two jobs of a
    service that places drivers off the head and one of a service with Ray's default, all three (one worker each)
    RUNNING on the worker node's 3 CPUs and past their first checkpoint when the head is killed; started again once
    both services said Ray is why they are not ready."""
    off_svc = serve_against(cluster, tmp_path_factory.mktemp("off"), SHUNTER_RAY_DRIVERS_OFF_HEAD="true")
    on_svc = serve_against(cluster, tmp_path_factory.mktemp("on"))
    off, on = httpx.Client(base_url=off_svc.url, timeout=30), httpx.Client(base_url=on_svc.url, timeout=30)
    try:
        posted = [off.post("/v1/jobs", json=SPEC) for _ in range(2)] + [on.post("/v1/jobs", json=SPEC)]
        assert all(r.status_code == 201 for r in posted), [r.text for r in posted]
        *off_ids, on_id = [r.json()["id"] for r in posted]
        jobs = [(off, i) for i in off_ids] + [(on, on_id)]
        wait_for(lambda: all(h.get(f"/v1/jobs/{i}").json()["state"] == "RUNNING" for h, i in jobs), timeout=180,
                 what="all three jobs RUNNING")  # fmt: skip
        head_before = head_node_id(cluster)
        drivers_off = {ray_job(cluster, f"shunter-{i}-1")["driver_node_id"] for i in off_ids}
        driver_on = ray_job(cluster, f"shunter-{on_id}-1")["driver_node_id"]
        wait_for(lambda: all(len(h.get(f"/v1/jobs/{i}/checkpoints").json()) >= 1 for h, i in jobs), timeout=240,
                 what="every job past its first checkpoint")  # fmt: skip
        cluster.kill()
        for h in (off, on):
            wait_for(lambda h=h: h.get("/readyz").status_code == 503, timeout=30, what="/readyz: Ray is not ready")
        time.sleep(2)
        cluster.start()
        for h in (off, on):
            wait_for(lambda h=h: h.get("/readyz").status_code == 200, timeout=90, what="/readyz ready again")
        yield Restarted(off, on, off_ids, on_id, drivers_off, driver_on, head_before)
    finally:
        off.close()
        on.close()
        off_svc.stop()
        on_svc.stop()


def wait_ended(http: httpx.Client, ids: list[str]) -> list[dict[str, Any]]:
    def ended() -> bool:
        return all(http.get(f"/v1/jobs/{i}").json()["state"] in ("SUCCEEDED", "FAILED", "CANCELLED") for i in ids)

    wait_for(ended, timeout=400, interval=1.0, what="every job to end")
    return [http.get(f"/v1/jobs/{i}").json() for i in ids]


def ray_job(head: ExternalHead, submission_id: str) -> dict[str, Any]:
    return dict(httpx.get(f"{head.dashboard_url}/api/jobs/{submission_id}", timeout=10).json())


def test_jobs_with_drivers_off_the_head_outlive_a_head_restart(restarted: Restarted, cluster: ExternalHead) -> None:
    http, ids = restarted.off, restarted.off_ids
    assert None not in restarted.drivers_off and restarted.head_before not in restarted.drivers_off  # off the head
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
    mine = sorted(j["submission_id"] for j in ray_ids if any(i in j["submission_id"] for i in ids))
    assert mine == sorted(f"shunter-{i}-1" for i in ids)  # never resubmitted


def test_a_job_whose_driver_died_with_the_head_is_resumed_not_left_running(restarted: Restarted) -> None:
    http, job_id = restarted.on, restarted.on_id
    assert restarted.driver_on == restarted.head_before  # Ray's default placement: the driver on the head
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
