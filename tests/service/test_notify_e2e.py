"""Notifications end to end (issue 18): a real `shunter serve`, a real Ray job, a real HTTP receiver on 127.0.0.1,
and a kill -9 of the service while a delivery is in flight. Every state change arrives, exactly once after
de-duplication by event id, each try signed with the entry's own secret."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from service.backends.ray_local import LocalHead, free_port
from service.policy.webhook_rules import verify
from tests.conftest import wait_for
from tests.service.conftest import Service, service_env, stop_leftover_ray_jobs
from tests.service.webhook_receiver import running_receiver

pytestmark = pytest.mark.slow
SECRET = "tenant-secret-0123456789"


def test_every_state_change_arrives_once_after_dedup_across_a_kill9(tmp_path: Path, ray_head: LocalHead) -> None:
    mode = {"accept": False}
    in_flight = threading.Event()

    def respond(path: str, n: int) -> tuple[int, dict[str, str]] | None:
        if not mode["accept"]:
            return 503, {}  # refused: retried with backoff
        if not in_flight.is_set():
            in_flight.set()  # the first try let through is held while the service is killed: it was received,
            time.sleep(3)  # but the sender never learns so, and sends it again after its claim lapses
        return 204, {}

    port = free_port()
    env = service_env(
        tmp_path, ray_head, port,
        SHUNTER_WEBHOOK_ALLOW_PRIVATE="true", SHUNTER_WEBHOOK_SECRET="cluster-secret-0123456789",
        SHUNTER_WEBHOOK_BACKOFF_SECONDS="0.5", SHUNTER_WEBHOOK_BACKOFF_MAX_SECONDS="1",
        SHUNTER_WEBHOOK_TIMEOUT_SECONDS="1", SHUNTER_WEBHOOK_POLL_SECONDS="0.2", SHUNTER_WEBHOOK_MAX_ATTEMPTS="100",
    )  # fmt: skip
    svc = Service(data_dir=tmp_path, port=port, env=env)
    with running_receiver(respond=respond) as rx:
        spec = {
            "name": "notified",
            "entrypoint": {"callable": "examples.mlp:train_loop"},
            "config": {"total_steps": 200, "checkpoint_every": 100, "report_every": 10, "step_sleep": 0.1},
            "resources": {"num_workers": 1, "resources_per_worker": {"CPU": 1}},
            "notify": [{"url": rx.url("/hooks/shunter"), "secret": SECRET,
                        "events": ["QUEUED", "STARTING", "RUNNING", "CANCELLING", "SUCCEEDED", "FAILED", "CANCELLED"]}],
        }  # fmt: skip
        svc.start()
        try:
            with svc.client() as c:
                job = c.submit(spec)
                wait_for(lambda: c.get(job.id).state == "RUNNING", timeout=180, what="job RUNNING")
                assert rx.requests and all(r.status == 503 for r in rx.requests)  # refused so far
                mode["accept"] = True
                assert in_flight.wait(timeout=30), "no delivery after the receiver opened"
            svc.kill9()  # while the receiver holds a try it has taken
            time.sleep(0.5)
            svc.start()
            with svc.client() as c:
                final = c.wait(job.id, timeout=240)
                assert final.state == "SUCCEEDED", final.last_error
                states = [(e.from_state, e.to_state) for e in c.events(job.id) if e.kind == "state"]

                def all_delivered() -> list[dict] | None:
                    rows = httpx.get(f"{svc.url}/v1/jobs/{job.id}/notifications", timeout=10).json()
                    return rows if len(rows) == len(states) and all(r["state"] == "delivered" for r in rows) else None

                rows = wait_for(all_delivered, timeout=90, what="every notification delivered")
        finally:
            svc.stop()
            stop_leftover_ray_jobs(ray_head)
    assert states == [(None, "QUEUED"), ("QUEUED", "STARTING"), ("STARTING", "RUNNING"), ("RUNNING", "SUCCEEDED")]
    # Every try, refused or taken, carries a valid signature of its exact body, by the entry's own secret only.
    for got in rx.requests:
        header = got.headers["x-shunter-signature"]
        assert verify(SECRET, got.body, header, now=got.at), header
        assert not verify("cluster-secret-0123456789", got.body, header, now=got.at)
        assert json.loads(got.body)["id"] == got.headers["x-shunter-event-id"]
    taken = [got for got in rx.requests if got.status == 204]
    unique = {got.headers["x-shunter-event-id"]: got.json for got in taken}
    assert len(taken) > len(unique)  # the try held across the kill was sent again: at least once, not at most
    received = sorted(unique.values(), key=lambda d: d["at"])
    assert [(d["from_state"], d["to_state"]) for d in received] == states  # each change once, after de-duplication
    assert {d["job"]["id"] for d in received} == {job.id}
    assert {r["event_id"] for r in rows} == set(unique)  # the API says delivered for exactly those
    assert all(r["attempts"] >= 1 and r["delivered_at"] and r["last_status"] == 204 for r in rows)
    assert SECRET not in (svc.data_dir / "serve.log").read_text()
