"""Issue 13's scenario: an external Ray head runs two 1-worker jobs for shunter; mid-training the head is killed and
started again at the same address (a KubeRay head pod restart, a rebooted head machine). shunter reconnects without
being restarted, says why it is not ready meanwhile, and both jobs resume from their checkpoints and succeed; the
lost attempts end as `cluster_restarted` and do not use up `max_attempts`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import wait_for
from tests.external_ray import ExternalHead, serve_against

pytestmark = pytest.mark.slow


@pytest.fixture
def head() -> Iterator[ExternalHead]:
    h = ExternalHead()
    h.start()
    yield h
    h.kill()


def test_jobs_survive_a_head_restart_without_restarting_shunter(tmp_path: Path, head: ExternalHead) -> None:
    svc = serve_against(head, tmp_path)
    try:
        http = httpx.Client(base_url=svc.url, timeout=30)
        spec = {"entrypoint": {"callable": "examples.mlp:train_loop"}, "resources": {"num_workers": 1},
                "config": {"total_steps": 60, "checkpoint_every": 10, "report_every": 1, "step_sleep": 0.15},
                "retries": {"max_attempts": 1, "backoff_seconds": 1}}  # fmt: skip
        posted = [http.post("/v1/jobs", json=spec) for _ in range(2)]
        assert all(r.status_code == 201 for r in posted), [r.text for r in posted]
        ids = [r.json()["id"] for r in posted]

        def checkpointed() -> bool:
            return all(len(http.get(f"/v1/jobs/{i}/checkpoints").json()) >= 1 for i in ids)

        wait_for(checkpointed, timeout=240, what="both jobs past their first checkpoint")
        head.kill()
        ready = wait_for(lambda: (r := http.get("/readyz")).status_code == 503 and r.json(), timeout=30,
                         what="/readyz to say Ray is not ready")  # fmt: skip
        assert ready["why"]["ray"].startswith("not ready: Ray"), ready  # type: ignore[index]
        time.sleep(2)
        head.start()  # the same address, a new cluster: Ray's job table is gone
        wait_for(lambda: http.get("/readyz").status_code == 200, timeout=60, what="/readyz ready again")

        def ended() -> bool:
            return all(http.get(f"/v1/jobs/{i}").json()["state"] in ("SUCCEEDED", "FAILED") for i in ids)

        wait_for(ended, timeout=400, interval=1.0, what="both jobs to end")
        for job_id in ids:
            job = http.get(f"/v1/jobs/{job_id}").json()
            assert (job["state"], job["step"]) == ("SUCCEEDED", 60), job
            attempts = http.get(f"/v1/jobs/{job_id}/attempts").json()
            assert attempts[0]["end_reason"] == "cluster_restarted" and job["attempt"] >= 2, attempts
            # Resumed: the first step of the last attempt follows a checkpoint of an earlier one.
            metrics = http.get(f"/v1/jobs/{job_id}/metrics", params={"name": "loss"}).json()
            first = min(m["step"] for m in metrics if m["attempt"] == job["attempt"])
            saved = {
                c["step"] for c in http.get(f"/v1/jobs/{job_id}/checkpoints").json() if c["attempt"] < job["attempt"]
            }
            assert first - 1 in saved and first > 1, (first, saved)
    finally:
        svc.stop()
