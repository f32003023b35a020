"""An elastic job grows into room that frees up (issue 16), on real Ray: it starts at what is free beside another job,
and once that job ends it is asked to yield, checkpoints at its next report, and runs again at its max from that
step, with `grow_requested` and `resized` events; no step is lost and no attempt is counted. Its first attempt is also
the proof that `num_workers: {min, max}` starts at what is free instead of waiting for its max: it says its size,
and Ray Train runs exactly that many workers."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.backends.ray_local import LocalHead, free_port
from tests.conftest import wait_for
from tests.service.conftest import Service, service_env, train_worker_nodes
from tests.service.test_e2e_serve import NEVER, mlp_spec

pytestmark = pytest.mark.slow


def test_an_elastic_job_grows_to_its_max_when_room_frees_up(ray_head: LocalHead, tmp_path: Path) -> None:
    svc = Service(data_dir=tmp_path, port=free_port(), env={})
    svc.env = service_env(tmp_path, ray_head, svc.port, SHUNTER_ELASTIC_GROW_AFTER_SECONDS="3")
    svc.start()
    try:
        with svc.client() as c:
            # 2 of the head's 4 CPUs held by a job that runs until cancelled: admitted is enough (its CPUs are counted
            # from then on), so the two jobs start side by side. One worker of 2 CPUs: holding room needs no second
            # worker process (~3 CPU-s to start; issue 34).
            blocker = c.submit(
                mlp_spec(total_steps=100_000, step_sleep=0.05, checkpoint_every=NEVER)
                | {"resources": {"num_workers": 1, "resources_per_worker": {"CPU": 2}}}
            )
            wait_for(lambda: c.get(blocker.id).state in ("STARTING", "RUNNING"), timeout=120, what="blocker admitted")
            spec = {"name": "grows", "entrypoint": {"callable": "examples.gpt2_tiny:train_loop"},
                    "config": {"steps": 40, "checkpoint_every": 1000, "step_sleep": 0.1},
                    "resources": {"num_workers": {"min": 1, "max": 4}, "resources_per_worker": {"CPU": 1}},
                    "retries": {"max_attempts": 1}}  # fmt: skip
            job = c.submit(spec)
            wait_for(lambda: (c.get(job.id).step or 0) >= 3, timeout=180, what="elastic job training")
            assert c.get(job.id).world_size == 2
            # What Ray Train runs: two workers, as admitted ("at 2 workers of 1 to 4"), not its max.
            assert len(train_worker_nodes(ray_head.dashboard_url, f"shunter-{job.id}-1")) == 2
            admitted = [e.message for e in c.events(job.id) if e.reason == "admitted"]
            assert admitted == ["at 2 workers of 1 to 4"], admitted
            c.cancel(blocker.id)
            done = c.wait(job.id, timeout=300)
            assert done.state == "SUCCEEDED", done.last_error
            assert done.attempt == 2 and done.world_size == 4 and done.step == 40
            assert done.spec["resources"]["num_workers"] == {"min": 1, "max": 4}  # the spec reads back as sent
            events = c.events(job.id)
            asked = [e.message for e in events if e.reason == "grow_requested"]
            assert len(asked) == 1 and "room for 4 workers (it runs 2)" in asked[0], asked
            assert [e.message for e in events if e.reason == "resized"] == [
                "grows from 2 to 4 workers (attempt 2 resumes from the latest checkpoint at the new size)"
            ]
            first, _ = c.attempts(job.id)
            assert first.end_reason == "preempted"
            saved = max(k.step for k in c.checkpoints(job.id) if k.attempt == 1)  # the yield's checkpoint
            losses = c.metrics(job.id, name="loss")
            assert max(m.step for m in losses if m.attempt == 1) == saved  # nothing trained past it
            assert min(m.step for m in losses if m.attempt == 2) == saved + 1
            assert not (tmp_path / "checkpoints" / job.id / "shunter-preempt").exists()  # the notice went with it
    finally:
        svc.stop()
