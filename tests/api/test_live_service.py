"""Issue 6 end to end: a real `shunter serve` with tokens, a real Ray head, real DDP training, real HTTP.

One job proves the walking skeleton (run to its end, its checkpoints on disk, its end before Ray's teardown, its log
kept), follow-logs (to the last line), the SSE timeline (every state change, in order), ownership,
Prometheus counters, the cluster view and the new CLI commands; then the logs are read with Ray out of reach.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from api.app import create_app
from api.client import ApiError, Client
from api.schemas import EventPublic
from service.backends.ray_jobs import RayJobs
from service.backends.ray_local import LocalHead, free_port
from service.config.settings import Settings
from service.core.masking import Masker
from service.runtime import Runtime
from tests.api.conftest import TOKENS
from tests.conftest import wait_for
from tests.service.conftest import Service, service_env, stop_leftover_ray_jobs

pytestmark = pytest.mark.slow

SPEC = {
    "name": "mlp-live",
    "entrypoint": {"callable": "examples.mlp:train_loop"},
    "config": {"total_steps": 30, "checkpoint_every": 10, "report_every": 5, "step_sleep": 0.2},  # RUNNING for 6 s+
    "strategy": {"kind": "ddp"},
    "resources": {"num_workers": 2, "resources_per_worker": {"CPU": 1}},
    "checkpoint": {"keep": 2},
}


def samples(text: str) -> dict[str, dict[tuple, float]]:
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


@pytest.fixture
def secured(tmp_path: Path, ray_head: LocalHead) -> Iterator[Service]:
    port = free_port()
    env = service_env(tmp_path, ray_head, port, SHUNTER_API_TOKENS=json.dumps(TOKENS), SHUNTER_TOKEN="tok-alice")
    svc = Service(data_dir=tmp_path, port=port, env=env).start()
    yield svc
    svc.stop()
    stop_leftover_ray_jobs(ray_head)


def maps_torch(job_id: str, process: str) -> bool | None:
    """Whether this job's `process` has torch's library mapped (None: no such process now). `process` is a Ray actor's
    class (in its process title) or a Python module run with -m (a word of its command line, not a shell's)."""
    import psutil

    for proc in psutil.process_iter(["cmdline"]):
        try:
            cmdline = proc.info["cmdline"] or []
            if not (f"ray::{process}" in " ".join(cmdline) or process in cmdline):
                continue
            if f"SHUNTER_JOB_ID={job_id}".encode() not in Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0"):
                continue
            return "libtorch" in Path(f"/proc/{proc.pid}/maps").read_text()
        except (OSError, psutil.Error):
            continue
    return None


def test_job_seen_through_every_view(secured: Service, ray_head: LocalHead) -> None:
    alice, bob, root = (Client(secured.url, token=t) for t in ("tok-alice", "tok-bob", "tok-root"))
    before = samples(alice.prometheus())
    # The job names a secret of alice's (issue 38): each rank checks it has the value, and prints it.
    value = f"hf_{secrets.token_hex(12)}"
    alice.put_secret("MLP_SECRET", value)
    digest = hashlib.sha256(value.encode()).hexdigest()
    config = {**SPEC["config"], "secret_name": "MLP_SECRET", "secret_sha256": digest}
    job = alice.submit({**SPEC, "entrypoint": {"callable": "tests.workers.loops:mlp_with_secret"}, "config": config,
                        "secrets": ["MLP_SECRET"]})  # fmt: skip

    streamed: list[EventPublic] = []
    followed: list[str] = []
    threads = [
        threading.Thread(target=lambda: streamed.extend(alice.stream_events(job.id))),
        threading.Thread(target=lambda: followed.extend(alice.follow_logs(job.id))),
    ]
    for t in threads:
        t.start()
    # Neither the attempt's driver nor Ray Train's controller imports torch (workers.torch_config, and the job's loop
    # imported on the workers only: workers.train_loop.UserCallable); its workers do, and the check sees it there.
    # Looked at once the ranks run (the controller has set up their process group), while the processes live.
    running = lambda: alice.get(job.id).state != "STARTING"  # noqa: E731
    wait_for(lambda: running() and maps_torch(job.id, "RayTrainWorker"), timeout=180, what="a worker with torch")
    for process in ("TrainController", "workers.driver"):
        found = wait_for(lambda p=process: running() and maps_torch(job.id, p) is not None, timeout=30,
                         what=f"the attempt's {process} while the job runs")  # fmt: skip
        assert found and maps_torch(job.id, process) is not True, f"the attempt's {process} imported torch"
    # Ray's record of the attempt (what its dashboard shows) holds neither the value nor the attempt token, and the
    # bootstrap credential it does hold was used by the driver: a copy buys nothing.
    record = httpx.get(f"{ray_head.dashboard_url}/api/jobs/shunter-{job.id}-1", timeout=10)
    assert value not in record.text and "SHUNTER_ATTEMPT_TOKEN" not in record.text and "sat1." not in record.text
    bootstrap = record.json()["runtime_env"]["env_vars"]["SHUNTER_BOOTSTRAP"]
    copied = httpx.post(f"{secured.url}/internal/v1/attempts/{job.id}/1/bootstrap", json={"nonce": "c" * 43},
                        headers={"Authorization": f"Bearer {bootstrap}"}, timeout=10)  # fmt: skip
    assert copied.status_code == 403 and "used already" in copied.text, copied.text
    # While it runs its log is Ray's: a ranged read asks the driver node's agent for those bytes only (issue 35, item
    # 11), the same bytes as the copy kept at its end (checked below).
    ranged = httpx.get(f"{secured.url}/v1/jobs/{job.id}/logs", params={"offset": 3, "limit_bytes": 64},
                       headers={"Authorization": "Bearer tok-alice"}, timeout=30)  # fmt: skip
    assert ranged.status_code == 200 and ranged.content, ranged.text
    assert ranged.headers["X-Next-Offset"] == str(3 + len(ranged.content))
    direct = RayJobs(ray_head.dashboard_url)
    running_head = direct.log_range(f"shunter-{job.id}-1", 0, 1 << 20)
    done = alice.wait(job.id, timeout=240)
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive(), "a follow stream did not end with the job"
    assert done.state == "SUCCEEDED", done.last_error
    assert done.attempt == 1 and done.step == 30
    assert done.loss is not None and done.loss < 1.0
    # The checkpoints lie on disk under the job's storage, as the API says.
    assert done.latest_checkpoint and Path(done.latest_checkpoint, "state.pt").is_file()
    assert Path(done.latest_checkpoint).is_relative_to(secured.data_dir / "checkpoints" / job.id)
    assert [k.step for k in alice.checkpoints(job.id)] == [10, 20, 30]
    assert [j.id for j in alice.list(state="SUCCEEDED").items] == [job.id]

    # It ended on its driver's word, before Ray's teardown let Ray call the Ray Job ended; Ray agrees once it has,
    # under the deterministic submission id, and the attempt's log is kept then.
    ray = RayJobs(ray_head.dashboard_url)
    info = wait_for(lambda: (i := ray.info(f"shunter-{job.id}-1")) is not None and i.is_terminal and i, timeout=60,
                    what="Ray's end of the job")  # fmt: skip
    assert info.status == "SUCCEEDED" and done.ray_submission_id == f"shunter-{job.id}-1"
    ray_job = httpx.get(f"{ray_head.dashboard_url}/api/jobs/shunter-{job.id}-1", timeout=10).json()
    ray_end = ray_job["end_time"]
    succeeded = next(e.at for e in alice.events(job.id) if e.to_state == "SUCCEEDED")
    assert succeeded.timestamp() < ray_end / 1000, "the job's end waited for Ray's teardown"
    kept = wait_for(lambda: (a := alice.attempts(job.id)[0]).ray_status == "SUCCEEDED" and a, timeout=30,
                    what="the attempt's log kept once Ray's job ended")  # fmt: skip
    assert kept.end_reason == "succeeded"
    assert "done: 30 steps" in (secured.data_dir / "logs" / job.id / "attempt-1.log").read_text()
    # The ranks printed the secret; the kept log has it starred out, and no answer about the job holds it.
    kept_text = (secured.data_dir / "logs" / job.id / "attempt-1.log").read_text()
    assert value not in kept_text and f"rank sees MLP_SECRET={'*' * len(value)}" in kept_text
    answers = [httpx.get(f"{secured.url}{path}", headers={"Authorization": "Bearer tok-alice"}, timeout=30).text
               for path in (f"/v1/jobs/{job.id}", f"/v1/jobs/{job.id}/events", f"/v1/jobs/{job.id}/logs",
                            f"/v1/jobs/{job.id}/attempts", "/v1/secrets", f"/ui/jobs/{job.id}")]  # fmt: skip
    assert [a[:200] for a in answers if value in a] == []
    ray_jobs = httpx.get(f"{ray_head.dashboard_url}/api/jobs/", timeout=10).text
    assert value not in ray_jobs and "sat1." not in ray_jobs
    kept_bytes = (secured.data_dir / "logs" / job.id / "attempt-1.log").read_bytes()
    assert kept_bytes[3 : 3 + len(ranged.content)] == ranged.content
    starred = Masker([value]).mask  # Ray's own copy has the value; shunter's has it starred out, byte for byte
    assert running_head is not None and running_head.data and kept_bytes.startswith(starred(running_head.data))
    assert direct.driver_logs._down_until == {}  # read from the driver node's agent, by range
    # The fallback: with that agent taken as out of reach, the head's state API gives the same bytes.
    direct.driver_logs._down_until[ray_job["driver_agent_http_address"].rstrip("/")] = float("inf")
    through_head = direct.log_range(f"shunter-{job.id}-1", 1, 100)
    assert through_head is not None
    assert (starred(through_head.data), through_head.size) == (kept_bytes[1:101], len(kept_bytes))
    direct.close()
    # The attempt's Ray Job started Ray Train's controller, workers and the helper it uses, and neither helper actor
    # that an attempt has no use for (workers.lean_trainer): no DatasetManager, no detached PlacementGroupCleaner; nor
    # a PreemptionWatcher: its drain watch runs in the controller (workers.drain_watcher; tests/service/test_drain.py).
    from ray.util.state import list_actors

    actors = list_actors(address=ray_head.dashboard_url, filters=[("job_id", "=", ray_job["job_id"])], limit=1000)
    classes = {a.class_name for a in actors}
    assert {"TrainController", "RayTrainWorker", "SynchronizationActor"} <= classes, classes
    assert not classes & {"DatasetManager", "PlacementGroupCleaner", "PreemptionWatcher"}, classes

    # Follow-logs ends with the job's last line (from shunter's stored copy of the attempt's log).
    text = "".join(followed)
    assert "done: 30 steps" in text, text[-2000:]
    assert text == alice.logs(job.id)
    # SSE: every state change, in order, each once; ids increase; the stream ended after the terminal event.
    changes = [(e.from_state, e.to_state) for e in streamed if e.kind == "state"]
    assert changes == [(None, "QUEUED"), ("QUEUED", "STARTING"), ("STARTING", "RUNNING"), ("RUNNING", "SUCCEEDED")]
    assert [e.id for e in streamed] == sorted({e.id for e in streamed})
    assert [e.id for e in streamed] == [e.id for e in alice.events(job.id)]
    assert any(e.reason == "ray_job_submitted" for e in streamed)
    assert any(e.reason == "checkpoint_saved" for e in streamed)

    # Ownership: bob can neither see nor cancel alice's job; the admin can see it.
    for call in (lambda: bob.get(job.id), lambda: bob.cancel(job.id), lambda: bob.logs(job.id)):
        with pytest.raises(ApiError) as info:
            call()
        assert info.value.status_code == 404
    assert job.id not in [j.id for j in bob.list().items]
    assert root.get(job.id).owner == "alice"

    # Prometheus: parses, and its counters moved.
    after = samples(alice.prometheus())
    assert after["shunter_admissions_total"][()] == before["shunter_admissions_total"][()] + 1
    assert after["shunter_jobs"][(("queue", "default"), ("state", "SUCCEEDED"))] == 1
    assert after["shunter_queue_wait_seconds_count"][()] == 1
    assert after["shunter_dispatcher_last_tick_seconds"][()] > 0
    assert after["shunter_cluster_nodes"][()] >= 1

    view = alice.cluster()
    assert view.dashboard_url == ray_head.dashboard_url and view.total.get("CPU", 0) >= 2 and view.nodes
    assert done.ray_dashboard_url == f"{ray_head.dashboard_url}/#/jobs/shunter-{job.id}-1"

    # The CLI, with the token from SHUNTER_TOKEN.
    losses = json.loads(secured.cli("metrics", job.id, "--name", "loss", "--json").stdout)
    assert [p["step"] for p in losses] == [5, 10, 15, 20, 25, 30] and all(p["name"] == "loss" for p in losses)
    assert [k["step"] for k in json.loads(secured.cli("checkpoints", job.id, "--json").stdout)][-1] == 30
    lines = secured.cli("events", job.id, "--follow", "--json").stdout.splitlines()
    assert [json.loads(line)["id"] for line in lines] == [e.id for e in streamed]
    assert "done: 30 steps" in secured.cli("logs", job.id, "-f").stdout
    for c in (alice, bob, root):
        c.close()

    # With Ray out of reach, shunter still has the log (its stored copy of the ended attempt).
    secured.stop()
    offline = Settings(
        database_url=f"sqlite:///{secured.data_dir / 'shunter.db'}", ray_address="127.0.0.1:9",
        ray_dashboard_url="http://127.0.0.1:9", api_tokens=TOKENS, data_dir=secured.data_dir,
    )  # fmt: skip
    runtime = Runtime.open(offline)
    try:
        with TestClient(create_app(runtime=runtime), headers={"Authorization": "Bearer tok-alice"}) as c:
            assert "done: 30 steps" in c.get(f"/v1/jobs/{job.id}/logs").text
            assert "done: 30 steps" in c.get(f"/v1/jobs/{job.id}/logs", params={"follow": "true"}).text
            assert [e["id"] for e in c.get(f"/v1/jobs/{job.id}/events").json()] == [e.id for e in streamed]
    finally:
        runtime.close()
