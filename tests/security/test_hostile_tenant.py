"""A hostile tenant on a real shared service (tokens, real Ray): mallory tries every attack of issue 12 over REST and
from inside a job of hers, and is refused each time, while alice's job runs to SUCCEEDED undisturbed.

Ray runs as the service's own Unix user here (as `shunter serve` does on one machine): what a job can then read of
other processes is the subject of test_separate_user.py, which runs Ray as another user.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.backends.ray_local import LocalHead, free_port
from tests.security.probe import result_of
from tests.service.conftest import Service, service_env

pytestmark = pytest.mark.slow
MARKER = "zz-secret-zz"  # every secret of the service below contains it; the probe looks for it everywhere
TOKENS = {
    f"alice-{MARKER}-1": {"owner": "alice", "queues": ["default"], "max_priority": 10},
    f"mallory-{MARKER}-2": {"owner": "mallory", "queues": ["default"], "max_priority": 10},
    f"admin-{MARKER}-3": {"owner": "ops", "admin": True},
}
ALICE, MALLORY = (f"alice-{MARKER}-1", f"mallory-{MARKER}-2")
SERVICE_SECRETS = {
    "SHUNTER_API_TOKENS": json.dumps(TOKENS),
    "SHUNTER_PROGRESS_SECRET": f"progress-{MARKER}-" + "k" * 32,
    "AWS_ACCESS_KEY_ID": f"AKIA{MARKER}",
    "AWS_SECRET_ACCESS_KEY": f"aws-{MARKER}-secret",
    "HF_TOKEN": f"hf-{MARKER}",
}
MLP = {"entrypoint": {"callable": "examples.mlp:train_loop"}, "resources": {"num_workers": 1}}


@pytest.fixture
def shared(tmp_path: Path, ray_head: LocalHead) -> Iterator[Service]:
    port = free_port()
    env = service_env(tmp_path, ray_head, port, **SERVICE_SECRETS, SHUNTER_QUEUES=json.dumps(
        {"default": {"preemption": True}, "research": {}}), SHUNTER_MAX_STREAMS_PER_CALLER="4")  # fmt: skip
    svc = Service(data_dir=tmp_path, port=port, env=env).start()
    yield svc
    svc.stop()


def client(svc: Service, token: str) -> httpx.Client:
    return httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {token}"}, timeout=30)


def wait_end(c: httpx.Client, job_id: str, timeout: float = 240) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = c.get(f"/v1/jobs/{job_id}").json()
        if job["state"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
            return job
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} did not end: {job}")


def test_a_hostile_tenant_is_refused_everything_and_disturbs_nobody(shared: Service) -> None:
    alice, mallory = client(shared, ALICE), client(shared, MALLORY)
    victim_spec = {**MLP, "priority": 10, "config": {"total_steps": 40, "checkpoint_every": 10, "step_sleep": 0.15}}
    victim = alice.post("/v1/jobs", json=victim_spec).json()["id"]

    # --- over REST ------------------------------------------------------------------------------------------------
    reads = ["", "/events", "/logs", "/checkpoints", "/metrics", "/attempts"]
    for method, path in [*(("GET", r) for r in reads), ("POST", "/cancel"), ("POST", "/retry")]:
        assert mallory.request(method, f"/v1/jobs/{victim}{path}").status_code == 404, path
    assert victim not in [j["id"] for j in mallory.get("/v1/jobs").json()["items"]]
    assert mallory.get("/v1/jobs", params={"owner": "alice"}).json()["items"] == []
    refused = {
        "jump the queue": ({**MLP, "priority": 1000}, 403, "priority"),
        "another queue": ({**MLP, "queue": "research"}, 403, "queue"),
        "read the service's home": ({**MLP, "runtime_env": {"working_dir": str(Path.home())}}, 422,
                                    "runtime_env.working_dir"),
        "upload the service's files": ({**MLP, "runtime_env": {"py_modules": ["/root"]}}, 422,
                                       "runtime_env.py_modules"),
        "requirements file on the host": ({**MLP, "runtime_env": {"pip": "/etc/passwd"}}, 422, "runtime_env.pip"),
        "steer the resume": ({**MLP, "runtime_env": {"env_vars": {"SHUNTER_RESUME_FROM": "/tmp/x"}}}, 422,
                             "runtime_env.env_vars.SHUNTER_RESUME_FROM"),
        "write into alice's prefix": ({**MLP, "checkpoint": {"storage": str(shared.data_dir / "checkpoints")}}, 422,
                                      "checkpoint.storage"),
        "free CPU": ({**MLP, "resources": {"num_workers": 4, "resources_per_worker": {"CPU": 0}}}, 422,
                     "resources.resources_per_worker.CPU"),
        "GPU that is not counted": ({**MLP, "resources": {"use_gpu": True, "resources_per_worker": {"GPU": 0}}},
                                    422, "resources.resources_per_worker.GPU"),
    }  # fmt: skip
    for name, (spec, status, field) in refused.items():
        r = mallory.post("/v1/jobs", json=spec)
        assert (r.status_code, r.json().get("field")) == (status, field), (name, r.text)
    assert mallory.post("/v1/jobs", content=b'{"config": "' + b"x" * (2 << 20) + b'"}',
                        headers={"content-type": "application/json"}).status_code == 413  # fmt: skip
    deep: dict = {}
    for _ in range(600):
        deep = {"a": deep}
    assert mallory.post("/v1/jobs", json={**MLP, "config": deep}).status_code == 422
    # An attempt API takes attempt tokens, not users': mallory's token writes nothing there.
    assert mallory.post(f"/internal/v1/attempts/{victim}/1/report", json={"metrics": {}}).status_code == 401

    # --- from inside a job ------------------------------------------------------------------------------------------
    reads_db = [str(shared.data_dir / "shunter.db")]
    probe_spec = {"entrypoint": {"callable": "tests.security.probe:train_loop"}, "priority": 10,
                  "config": {"victim": victim, "marker": MARKER, "read": reads_db}}  # fmt: skip
    probe = mallory.post("/v1/jobs", json=probe_spec).json()["id"]
    # Streams are bounded per caller: mallory's fifth concurrent follow is refused, and alice is served meanwhile.
    streams = [mallory.stream("GET", f"/v1/jobs/{probe}/events", params={"follow": "true"}) for _ in range(5)]
    opened = [s.__enter__() for s in streams]
    try:
        assert [r.status_code for r in opened].count(429) == 1
        started = time.monotonic()
        # Served, not starved: a request starved of a database connection would wait out the pool's 30 s checkout
        # timeout (the bound is what tells the two apart, with room for a loaded machine).
        assert alice.get("/v1/jobs").status_code == 200 and time.monotonic() - started < 10.0
    finally:
        for s in streams:
            s.__exit__(None, None, None)
    assert wait_end(mallory, probe)["state"] == "SUCCEEDED"
    found = result_of(mallory.get(f"/v1/jobs/{probe}/logs").text)
    assert found["env_with_secret"] == [], "a service secret reached the job's environment"
    env = found["env"]
    assert not any("DATABASE" in name for name in env) and "SHUNTER_JOB_SPEC" not in env
    assert str(shared.data_dir / "shunter.db") not in json.dumps(env)
    assert found["write_victim_progress"] == 403 and found["end_victim_attempt"] == 403
    assert found["read_victim_spec"] == 403
    assert found["user_api_with_attempt_token"] == 401 and found["user_api_without_token"] == 401

    # --- alice's job, undisturbed ----------------------------------------------------------------------------------
    done = wait_end(alice, victim)
    assert (done["state"], done["attempt"], done["step"]) == ("SUCCEEDED", 1, 40), done
    assert all(m["value"] != 666.0 for m in alice.get(f"/v1/jobs/{victim}/metrics").json())
    reasons = [(e["kind"], e["reason"]) for e in alice.get(f"/v1/jobs/{victim}/events").json()]
    assert not any(kind == "preemption" or reason.startswith("cancel") for kind, reason in reasons), reasons
    assert "pwned" not in json.dumps(alice.get(f"/v1/jobs/{victim}/attempts").json())
