"""Fault tolerance on a real Ray head with real training: retries that resume, errors that do not, timeouts,
explicit retry, and a control plane killed again and again."""

from __future__ import annotations

import random
import time

import pytest

from service.backends.ray_jobs import RayJobs
from service.backends.ray_local import LocalHead
from tests.conftest import wait_for
from tests.service.conftest import Service
from tests.service.test_e2e_serve import NEVER, mlp_spec

pytestmark = pytest.mark.slow


# What these tests prove (retry decisions, timeouts, explicit retries, a killed control plane) is the same at one
# worker as at two, and a worker process costs ~5 CPU-seconds to start on the 2-core CI machine (issue 34: the fewest
# workers an assertion needs). A worker lost in a group of two is the first test's, on the module's default of two.
ONE_WORKER = {"num_workers": 1, "resources_per_worker": {"CPU": 1}}


def first_step_of_attempt(c, job_id: str, attempt: int) -> int:
    return min(m.step for m in c.metrics(job_id, name="loss") if m.attempt == attempt)


def test_lost_worker_retries_attempt_and_resumes_from_last_checkpoint(service: Service) -> None:
    spec = mlp_spec(total_steps=40, checkpoint_every=10, report_every=1, crash_at_step=25)
    spec["retries"] = {"max_attempts": 2, "backoff_seconds": 1, "max_worker_failures": 0}
    with service.client() as c:
        job = c.wait(c.submit(spec).id, timeout=300)
        assert job.state == "SUCCEEDED", job.last_error
        assert job.attempt == 2 and job.step == 40
        first, second = c.attempts(job.id)
        assert first.end_reason in ("worker_lost", "node_lost"), first.message
        assert second.end_reason == "succeeded"
        # Attempt 1 checkpointed at 10 and 20 and died at 25; attempt 2 starts from step 20: its first step is 21.
        assert first_step_of_attempt(c, job.id, 2) == 21
        assert "resumed from step 20" in c.logs(job.id, attempt=2)
        events = c.events(job.id)
        retry = [e for e in events if e.reason == "retry_decided"]
        assert len(retry) == 1 and "attempt 2/2" in (retry[0].message or "")
        changes = [(e.from_state, e.to_state) for e in events if e.kind == "state"]
        assert ("RUNNING", "QUEUED") in changes
        assert [k.attempt for k in c.checkpoints(job.id)][:2] == [1, 1]


def test_user_error_fails_at_once_without_retry(service: Service) -> None:
    spec = mlp_spec(total_steps=40, fail_at_step=5) | {"resources": ONE_WORKER}
    spec["retries"] = {"max_attempts": 3, "backoff_seconds": 1}
    with service.client() as c:
        job = c.wait(c.submit(spec).id, timeout=240)
        assert job.state == "FAILED"
        assert job.attempt == 1 and job.end_reason == "user_error"
        assert "injected failure at step 5" in (job.last_error or "")
        assert "injected failure at step 5" in c.logs(job.id)


def test_timeout_ends_job_and_is_not_retried(service: Service, ray_head: LocalHead) -> None:
    spec = mlp_spec(total_steps=100_000, step_sleep=0.05, checkpoint_every=NEVER) | {
        "timeout_seconds": 12,
        "resources": ONE_WORKER,
    }
    spec["retries"] = {"max_attempts": 3, "backoff_seconds": 1}
    with service.client() as c:
        started = time.monotonic()
        job = c.wait(c.submit(spec).id, timeout=180)
        assert job.state == "FAILED" and job.end_reason == "timeout", (job.state, job.end_reason, job.last_error)
        assert job.attempt == 1
        assert 12 <= time.monotonic() - started < 90
        assert RayJobs(ray_head.dashboard_url).info(f"shunter-{job.id}-1").status == "STOPPED"


def test_explicit_retry_resumes_a_cancelled_job_from_its_checkpoint(service: Service) -> None:
    spec = mlp_spec(total_steps=60, checkpoint_every=10, report_every=1, step_sleep=0.15) | {"resources": ONE_WORKER}
    with service.client() as c:
        job = c.submit(spec)
        wait_for(lambda: (c.get(job.id).step or 0) >= 22, timeout=180, what="job past step 22")
        c.cancel(job.id)
        assert c.wait(job.id, timeout=90).state == "CANCELLED"
        last = max(k.step for k in c.checkpoints(job.id) if k.complete)
        c.retry(job.id)
        done = c.wait(job.id, timeout=300)
        assert done.state == "SUCCEEDED" and done.attempt == 2 and done.step == 60
        assert first_step_of_attempt(c, job.id, 2) == last + 1
        assert [e.reason for e in c.events(job.id) if e.to_state == "QUEUED"][-1] == "retry_requested"


def test_service_killed_repeatedly_loses_and_duplicates_nothing(service: Service, ray_head: LocalHead) -> None:
    """kill -9 at random moments (before claim, during submit, while running, while finishing), then restart."""
    rng = random.Random(1234)
    with service.client() as c:
        ids = [
            c.submit(mlp_spec(total_steps=25, step_sleep=0.05) | {"name": f"crash-{i}", "resources": ONE_WORKER}).id
            for i in range(4)
        ]
    kills = 0
    for _ in range(5):
        # Random moments across the batch's life: before a claim, mid-submission, while running, while finishing.
        time.sleep(rng.uniform(0.5, 8.0))
        service.kill9()
        kills += 1
        service.start()
    with service.client() as c:
        finals = [c.wait(i, timeout=300) for i in ids]
        assert [j.state for j in finals] == ["SUCCEEDED"] * 4, [(j.state, j.last_error) for j in finals]
        ray_ids = RayJobs(ray_head.dashboard_url).list_submission_ids()
        for job in finals:
            mine = sorted(s for s in ray_ids if job.id in s)
            # One Ray Job per attempt, never two for one attempt (Ray refuses a duplicate submission id anyway;
            # the event log shows shunter never tried twice).
            assert mine == [f"shunter-{job.id}-{n}" for n in range(1, job.attempt + 1)]
            submits = [e for e in c.events(job.id) if e.reason == "ray_job_submitted"]
            assert len(submits) <= job.attempt
            assert job.step == 25
    assert kills >= 5
