"""Admission and preemption on a real 3-node Ray cluster (head 1 CPU, nodes a and b 1 CPU each)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.backends.ray_local import free_port
from tests.conftest import wait_for
from tests.service.conftest import MultiNode, Service, service_env, stop_leftover_ray_jobs, train_worker_nodes
from tests.service.test_e2e_serve import NEVER, mlp_spec

pytestmark = pytest.mark.slow


@pytest.fixture
def svc(multinode: MultiNode, tmp_path: Path) -> Iterator[Service]:
    service = Service(data_dir=tmp_path, port=free_port(), env={})
    service.env = service_env(
        tmp_path, multinode.head, service.port,
        SHUNTER_QUEUES=json.dumps({"urgent": {"preemption": True}}), SHUNTER_PREEMPTION_GRACE_SECONDS="60",
    )  # fmt: skip
    service.start()
    yield service
    service.stop()
    stop_leftover_ray_jobs(multinode.head)


def state_events(c, job_id: str) -> list:
    return [e for e in c.events(job_id) if e.kind == "state"]


@pytest.mark.parametrize(("placement", "distinct_nodes"), [("pack", 1), ("spread", 2)])
def test_pack_and_spread_placement(svc: Service, multinode: MultiNode, placement: str,
                                   distinct_nodes: int) -> None:  # fmt: skip
    spec = mlp_spec(total_steps=100_000, step_sleep=0.05, checkpoint_every=NEVER)
    spec["resources"] = {"num_workers": 2, "resources_per_worker": {"CPU": 0.5}, "placement": placement}
    with svc.client() as c:
        job = c.submit(spec)
        wait_for(lambda: c.get(job.id).state == "RUNNING", timeout=120, what="RUNNING")
        nodes = train_worker_nodes(multinode.head.dashboard_url, f"shunter-{job.id}-1")
        assert len(nodes) == 2 and len(set(nodes)) == distinct_nodes
        c.cancel(job.id)
        assert c.wait(job.id, timeout=90).state == "CANCELLED"


def test_higher_priority_job_preempts_and_the_preempted_one_resumes(svc: Service) -> None:
    low_spec = {
        # Preemption stays inside a queue (issue 12): the low job runs in the urgent queue too.
        "name": "low", "priority": 0, "queue": "urgent", "entrypoint": {"callable": "examples.gpt2_tiny:train_loop"},
        "config": {"steps": 80, "checkpoint_every": 100, "step_sleep": 0.1},
        "resources": {"num_workers": 2}, "retries": {"max_attempts": 1},
    }  # fmt: skip
    with svc.client() as c:
        low = c.submit(low_spec)
        wait_for(lambda: (c.get(low.id).step or 0) >= 5, timeout=180, what="low job past step 5")
        high = c.submit(mlp_spec(total_steps=20) | {"name": "high", "priority": 10, "queue": "urgent"})
        done_high = c.wait(high.id, timeout=300)
        assert done_high.state == "SUCCEEDED", done_high.last_error
        done_low = c.wait(low.id, timeout=300)
        assert done_low.state == "SUCCEEDED", done_low.last_error
        assert done_low.attempt == 2  # max_attempts is 1: the preempted attempt did not count as a failure
        events = c.events(low.id)
        assert any(e.reason == "preemption_requested" and high.id in (e.message or "") for e in events)
        assert ("RUNNING", "QUEUED", "preempted") in [(e.from_state, e.to_state, e.reason) for e in events]
        first = c.attempts(low.id)[0]
        assert first.end_reason == "preempted"
        # The checkpoint taken on the notice (the schedule, every 100 steps, makes none in 80): attempt 2 starts there.
        notice_ckpt = max(k.step for k in c.checkpoints(low.id) if k.attempt == 1)
        assert notice_ckpt < 100
        resumed = min(m.step for m in c.metrics(low.id, name="loss") if m.attempt == 2)
        assert resumed == notice_ckpt + 1
        # The high job got the room the low one gave up: admitted after the low one's last step of attempt 1.
        high_start = next(e.at for e in state_events(c, high.id) if e.to_state == "STARTING")
        low_last_step = max(m.at for m in c.metrics(low.id, name="loss") if m.attempt == 1)
        assert high_start >= low_last_step
