"""The walking skeleton end to end: a real `shunter serve`, a real Ray head, real DDP training on gloo."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from api.client import ApiError
from service.ray_jobs import RayJobs
from service.ray_local import LocalHead
from tests.conftest import wait_for
from tests.service.conftest import Service

pytestmark = pytest.mark.slow


def mlp_spec(**config: object) -> dict:
    base = {"total_steps": 30, "checkpoint_every": 10, "report_every": 5}
    base.update(config)
    return {
        "name": "mlp-test",
        "entrypoint": {"callable": "examples.mlp:train_loop"},
        "config": base,
        "strategy": {"kind": "ddp"},
        "resources": {"num_workers": 2, "resources_per_worker": {"CPU": 1}},
        "checkpoint": {"keep": 2},
    }


def alive_train_workers(head: LocalHead, submission_id: str) -> list[dict]:
    """RayTrainWorker actors still alive in that Ray Job (asked of Ray's own state API)."""
    from ray.util.state import list_actors

    ray_job_id = httpx.get(f"{head.dashboard_url}/api/jobs/{submission_id}", timeout=10).json()["job_id"]
    actors = list_actors(address=head.dashboard_url, filters=[("state", "=", "ALIVE")], limit=1000)
    return [a for a in actors if a.job_id == ray_job_id and "RayTrainWorker" in (a.class_name or "")]


def test_submit_runs_to_success_with_checkpoint(service: Service, ray_head: LocalHead) -> None:
    with service.client() as c:
        created = c.submit(mlp_spec())
        assert created.state == "QUEUED"
        job = c.wait(created.id, timeout=240)
        assert job.state == "SUCCEEDED", job.last_error
        assert job.attempt == 1
        assert job.step == 30
        assert job.loss is not None and job.loss < 1.0
        # The checkpoint lies on disk under the job's storage, as the API says.
        assert job.latest_checkpoint and Path(job.latest_checkpoint, "state.pt").is_file()
        assert Path(job.latest_checkpoint).is_relative_to(service.data_dir / "checkpoints" / job.id)
        ckpts = c.checkpoints(job.id)
        assert [k.step for k in ckpts] == [10, 20, 30]
        # The event history is the documented path, each change once, in order.
        changes = [(e.from_state, e.to_state) for e in c.events(job.id) if e.kind == "state"]
        assert changes == [(None, "QUEUED"), ("QUEUED", "STARTING"), ("STARTING", "RUNNING"), ("RUNNING", "SUCCEEDED")]
        assert any(e.reason == "ray_job_submitted" for e in c.events(job.id))
        # It ended on its driver's word, before Ray's teardown let Ray call the Ray Job ended; Ray agrees once it
        # has, under the deterministic submission id, and the attempt's log is kept then.
        ray = RayJobs(ray_head.dashboard_url)
        info = wait_for(lambda: (i := ray.info(f"shunter-{job.id}-1")) is not None and i.is_terminal and i,
                        timeout=60, what="Ray's end of the job")  # fmt: skip
        assert info.status == "SUCCEEDED"
        assert job.ray_submission_id == f"shunter-{job.id}-1"
        ray_end = httpx.get(f"{ray_head.dashboard_url}/api/jobs/shunter-{job.id}-1", timeout=10).json()["end_time"]
        succeeded = next(e.at for e in c.events(job.id) if e.to_state == "SUCCEEDED")
        assert succeeded.timestamp() < ray_end / 1000, "the job's end waited for Ray's teardown"
        kept = wait_for(lambda: (a := c.attempts(job.id)[0]).ray_status == "SUCCEEDED" and a, timeout=30,
                        what="the attempt's log kept once Ray's job ended")  # fmt: skip
        assert kept.end_reason == "succeeded"
        assert "done: 30 steps" in (service.data_dir / "logs" / job.id / "attempt-1.log").read_text()
        # Logs come from the driver, worker output included, and stay readable from shunter's copy.
        logs = c.logs(job.id)
        assert "done: 30 steps" in logs
        loss_series = c.metrics(job.id, name="loss")
        assert [m.step for m in loss_series] == [5, 10, 15, 20, 25, 30]
        listed = c.list(state="SUCCEEDED")
        assert [j.id for j in listed.items] == [job.id]


def test_elastic_job_starts_at_the_size_that_fits_and_trains_at_it(service: Service, ray_head: LocalHead) -> None:
    """Issue 16: `num_workers: {min: 1, max: 8}` on the 4-CPU test head starts at what is free (at most 4) instead of
    waiting for 8, says its size, holds that much, and Ray Train runs exactly that many workers."""
    spec = mlp_spec(total_steps=10, checkpoint_every=5)
    spec["resources"] = {"num_workers": {"min": 1, "max": 8}, "resources_per_worker": {"CPU": 1}}
    with service.client() as c:
        job = c.wait(c.submit(spec).id, timeout=240)
        assert job.state == "SUCCEEDED", job.last_error
        assert job.world_size is not None and 1 <= job.world_size <= 4, job.world_size
        assert job.latest_metrics and job.latest_metrics["world_size"] == job.world_size  # what Ray Train ran
        admitted = [e.message for e in c.events(job.id) if e.reason == "admitted"]
        assert admitted == [f"at {job.world_size} workers of 1 to 8"]
        assert c.get(job.id).spec["resources"]["num_workers"] == {"min": 1, "max": 8}


def test_cancel_running_job_stops_ray_job_and_workers(service: Service, ray_head: LocalHead) -> None:
    with service.client() as c:
        job = c.submit(mlp_spec(total_steps=100_000, step_sleep=0.05))
        wait_for(lambda: c.get(job.id).state == "RUNNING", timeout=120, what="job RUNNING")
        sub_id = f"shunter-{job.id}-1"
        assert alive_train_workers(ray_head, sub_id), "expected live train workers while RUNNING"
        body = c.cancel(job.id)
        assert body["state"] == "CANCELLING"
        final = c.wait(job.id, timeout=90)
        assert final.state == "CANCELLED"
        assert RayJobs(ray_head.dashboard_url).info(sub_id).status == "STOPPED"
        wait_for(lambda: not alive_train_workers(ray_head, sub_id), timeout=60, what="train workers to exit")
        with pytest.raises(ApiError) as err:
            c.cancel(job.id)
        assert err.value.status_code == 409 and err.value.code == "conflict"


def test_cancel_queued_job_never_reaches_ray(service: Service, ray_head: LocalHead) -> None:
    with service.client() as c:
        # A 4-worker job holds all 4 logical CPUs of the test head, so the next job must wait in the queue.
        blocker = c.submit(mlp_spec(total_steps=100_000, step_sleep=0.05) | {"resources": {"num_workers": 4}})
        wait_for(lambda: c.get(blocker.id).state in ("STARTING", "RUNNING"), timeout=60, what="blocker admitted")
        queued = c.submit(mlp_spec())
        assert c.get(queued.id).state == "QUEUED"
        c.cancel(queued.id)
        assert c.get(queued.id).state == "CANCELLED"
        assert RayJobs(ray_head.dashboard_url).info(f"shunter-{queued.id}-1") is None
        c.cancel(blocker.id)
        assert c.wait(blocker.id, timeout=90).state == "CANCELLED"
        # Now there is room, and admission passes go past where the cancelled job stood (a later job is admitted):
        # it still never reaches Ray.
        later = c.submit(mlp_spec())
        wait_for(lambda: c.get(later.id).state != "QUEUED", timeout=90, what="a later job admitted")
        assert c.get(queued.id).state == "CANCELLED"
        assert RayJobs(ray_head.dashboard_url).info(f"shunter-{queued.id}-1") is None
        c.cancel(later.id)
        assert c.wait(later.id, timeout=90).state in ("CANCELLED", "SUCCEEDED")


def test_restart_after_kill9_adopts_running_ray_job(service: Service, ray_head: LocalHead) -> None:
    with service.client() as c:
        job = c.submit(mlp_spec(total_steps=60, step_sleep=0.1))
        wait_for(lambda: c.get(job.id).state == "RUNNING", timeout=120, what="job RUNNING")
    service.kill9()
    service.start()
    with service.client() as c:
        final = c.wait(job.id, timeout=240)
        assert final.state == "SUCCEEDED", final.last_error
        assert final.attempt == 1 and final.step == 60
        reasons = [e.reason for e in c.events(job.id)]
        assert "adopted" in reasons  # the restarted dispatcher took the lease over
        assert reasons.count("ray_job_submitted") == 1  # ... and did not submit again
    ids = [s for s in RayJobs(ray_head.dashboard_url).list_submission_ids() if job.id in s]
    assert ids == [f"shunter-{job.id}-1"]


def test_gpu_job_on_cpu_cluster_is_refused(service: Service) -> None:
    with service.client() as c:
        wait_for(lambda: httpx.get(f"{service.url}/readyz").status_code == 200, what="ready")
        wait_for(lambda: _snapshot_taken(service), what="dispatcher to record the cluster")
        spec = mlp_spec() | {"resources": {"num_workers": 2, "use_gpu": True}}
        with pytest.raises(ApiError) as err:
            c.submit(spec)
        assert err.value.status_code == 422
        assert err.value.body["field"] == "resources.use_gpu"
        too_many = mlp_spec() | {"resources": {"num_workers": 64}}
        with pytest.raises(ApiError) as err:
            c.submit(too_many)
        assert err.value.status_code == 422 and err.value.body["field"] == "resources.num_workers"
        assert c.list().items == []  # nothing was queued


def _snapshot_taken(service: Service) -> bool:
    import sqlite3

    with sqlite3.connect(service.data_dir / "shunter.db") as conn:
        return bool(conn.execute("SELECT count(*) FROM cluster_snapshots").fetchone()[0])


def test_cli_commands_against_real_service(service: Service, tmp_path: Path, repo_root: Path) -> None:
    spec_file = tmp_path / "job.json"
    spec_file.write_text(json.dumps(mlp_spec(total_steps=20)))
    out = service.cli("submit", str(spec_file), "--json")
    job_id = json.loads(out.stdout)["id"]
    watched = service.cli("watch", job_id)
    assert "SUCCEEDED" in watched.stdout
    status = json.loads(service.cli("status", job_id, "--json").stdout)
    assert status["state"] == "SUCCEEDED" and status["step"] == 20
    assert job_id in service.cli("list").stdout
    assert "done: 20 steps" in service.cli("logs", job_id).stdout
    assert "RUNNING" in service.cli("events", job_id).stdout
    refused = service.cli("cancel", job_id, check=False)
    assert refused.returncode == 1 and "already ended" in refused.stderr
    bad = service.cli("submit", str(repo_root / "pyproject.toml"), check=False)
    assert bad.returncode != 0
