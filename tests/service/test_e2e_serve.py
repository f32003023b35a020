"""The walking skeleton end to end: a real `shunter serve`, a real Ray head, real DDP training on gloo. A job run to
its end with its checkpoints, events, logs and Ray's own record is proven in tests/api/test_live_service.py (the same
job, seen through every view); an elastic job's start at the size that fits in tests/service/test_growth_ray.py."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from api.client import ApiError
from service.backends.ray_jobs import RayJobs
from service.backends.ray_local import LocalHead
from tests.conftest import wait_for
from tests.service.conftest import Service

pytestmark = pytest.mark.slow


# checkpoint_every for a job that runs until cancelled and whose checkpoints no test reads: one every 10 steps of
# 0.05 s kept a blocker writing ~2 checkpoints a second, CPU taken from the job under test on 2 cores.
NEVER = 10**9


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


# One worker where what a test asserts is the same at one as at two (the control plane's part: queueing, cancel,
# adoption, the CLI): a worker process costs ~3 CPU-s to start on the 2-core CI machine (issue 34). DDP across two
# workers stays proven in the module's other jobs and in tests/service/test_strategies_e2e.py.
ONE_WORKER = {"num_workers": 1, "resources_per_worker": {"CPU": 1}}


def alive_train_workers(head: LocalHead, submission_id: str) -> list[dict]:
    """RayTrainWorker actors still alive in that Ray Job (asked of Ray's own state API)."""
    from ray.util.state import list_actors

    ray_job_id = httpx.get(f"{head.dashboard_url}/api/jobs/{submission_id}", timeout=10).json()["job_id"]
    actors = list_actors(address=head.dashboard_url, filters=[("state", "=", "ALIVE")], limit=1000)
    return [a for a in actors if a.job_id == ray_job_id and "RayTrainWorker" in (a.class_name or "")]


def test_cancel_a_queued_job_never_reaches_ray_and_a_running_one_stops_its_ray_job_and_workers(
    service: Service, ray_head: LocalHead
) -> None:
    with service.client() as c:
        # A job holds all 4 logical CPUs of the test head (one worker of 4: holding room needs no more worker
        # processes, ~3 CPU-s each to start; issue 34), so the next job must wait in the queue.
        endless = mlp_spec(total_steps=100_000, step_sleep=0.05, checkpoint_every=NEVER)
        blocker = c.submit(endless | {"resources": ONE_WORKER | {"resources_per_worker": {"CPU": 4}}})
        wait_for(lambda: c.get(blocker.id).state in ("STARTING", "RUNNING"), timeout=60, what="blocker admitted")
        queued = c.submit(mlp_spec() | {"resources": ONE_WORKER})
        assert c.get(queued.id).state == "QUEUED"
        c.cancel(queued.id)
        assert c.get(queued.id).state == "CANCELLED"
        assert RayJobs(ray_head.dashboard_url).info(f"shunter-{queued.id}-1") is None
        # The running one: its Ray Job is stopped and its train workers exit.
        wait_for(lambda: c.get(blocker.id).state == "RUNNING", timeout=120, what="blocker RUNNING")
        sub_id = f"shunter-{blocker.id}-1"
        assert alive_train_workers(ray_head, sub_id), "expected live train workers while RUNNING"
        assert c.cancel(blocker.id)["state"] == "CANCELLING"
        assert c.wait(blocker.id, timeout=90).state == "CANCELLED"
        assert RayJobs(ray_head.dashboard_url).info(sub_id).status == "STOPPED"
        wait_for(lambda: not alive_train_workers(ray_head, sub_id), timeout=60, what="train workers to exit")
        with pytest.raises(ApiError) as err:
            c.cancel(blocker.id)
        assert err.value.status_code == 409 and err.value.code == "conflict"
        # Now there is room, and admission passes go past where the cancelled job stood (a later job is admitted):
        # it still never reaches Ray.
        later = c.submit(mlp_spec() | {"resources": ONE_WORKER})
        wait_for(lambda: c.get(later.id).state != "QUEUED", timeout=90, what="a later job admitted")
        assert c.get(queued.id).state == "CANCELLED"
        assert RayJobs(ray_head.dashboard_url).info(f"shunter-{queued.id}-1") is None
        c.cancel(later.id)
        assert c.wait(later.id, timeout=90).state in ("CANCELLED", "SUCCEEDED")


def test_restart_after_kill9_adopts_running_ray_job(service: Service, ray_head: LocalHead) -> None:
    with service.client() as c:
        job = c.submit(mlp_spec(total_steps=60, step_sleep=0.1) | {"resources": ONE_WORKER})
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
        spec = mlp_spec() | {"name": "refused-gpu", "resources": {"num_workers": 2, "use_gpu": True}}
        with pytest.raises(ApiError) as err:
            c.submit(spec)
        assert err.value.status_code == 422
        assert err.value.body["field"] == "resources.use_gpu"
        too_many = mlp_spec() | {"name": "refused-64", "resources": {"num_workers": 64}}
        with pytest.raises(ApiError) as err:
            c.submit(too_many)
        assert err.value.status_code == 422 and err.value.body["field"] == "resources.num_workers"
        listed = {j.name for j in c.list(limit=500).items}  # the module's service: earlier tests' jobs are there
        assert not listed & {"refused-gpu", "refused-64"}, listed  # nothing was queued


def _snapshot_taken(service: Service) -> bool:
    import sqlite3

    with sqlite3.connect(service.data_dir / "shunter.db") as conn:
        return bool(conn.execute("SELECT count(*) FROM cluster_snapshots").fetchone()[0])


def test_cli_commands_against_real_service(service: Service, tmp_path: Path, repo_root: Path) -> None:
    spec_file = tmp_path / "job.json"
    spec_file.write_text(json.dumps(mlp_spec(total_steps=20) | {"resources": ONE_WORKER}))
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
