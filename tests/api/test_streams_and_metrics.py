"""SSE framing and resume, Prometheus text and the cluster view, over the real app and a real SQLite file."""

from __future__ import annotations

import json
from collections.abc import Callable

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlmodel import Session

from service.lifecycle.state import transition
from service.store.models import ClusterSnapshot, Job, JobState
from tests.api.conftest import GOOD, TOKENS


def parse_sse(body: str) -> list[dict]:
    """Each message as {"id": ..., "data": ...}; comments and `retry:` lines skipped."""
    messages = []
    for block in body.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if line and not line.startswith(":"))
        if "data" in fields:
            messages.append({"id": int(fields["id"]), "data": json.loads(fields["data"])})
    return messages


def test_job_stream_ends_after_terminal_event_and_resumes(app_client: Callable[..., TestClient]) -> None:
    c = app_client()
    job = c.post("/v1/jobs", json=GOOD).json()
    c.post(f"/v1/jobs/{job['id']}/cancel")
    r = c.get(f"/v1/jobs/{job['id']}/events", params={"follow": "true"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    messages = parse_sse(r.text)
    assert [(m["data"]["from_state"], m["data"]["to_state"]) for m in messages] == [
        (None, "QUEUED"), ("QUEUED", "CANCELLED")
    ]  # fmt: skip
    assert all(m["id"] == m["data"]["id"] for m in messages)
    resumed = c.get(f"/v1/jobs/{job['id']}/events?follow=true", headers={"Last-Event-ID": str(messages[0]["id"])})
    assert [m["id"] for m in parse_sse(resumed.text)] == [messages[1]["id"]]
    assert c.get(f"/v1/jobs/{job['id']}/events", headers={"Last-Event-ID": "x"}).status_code == 422


def test_all_events_stream_is_scoped_to_the_caller(app_client: Callable[..., TestClient]) -> None:
    alice, bob = app_client("tok-alice", tokens=TOKENS), app_client("tok-bob", tokens=TOKENS)
    a = alice.post("/v1/jobs", json=GOOD).json()
    bob.post("/v1/jobs", json=GOOD)
    r = alice.get("/v1/events", params={"follow": "true", "timeout_seconds": 0.5})
    assert {m["data"]["job_id"] for m in parse_sse(r.text)} == {a["id"]}


def test_prometheus_text_parses_and_moves(app_client: Callable[..., TestClient]) -> None:
    c = app_client()

    def scrape() -> dict[str, dict[tuple, float]]:
        r = c.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        out: dict[str, dict[tuple, float]] = {}
        for family in text_string_to_metric_families(r.text):
            for s in family.samples:
                out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
        return out

    first = scrape()
    assert first["shunter_admissions_total"][()] == 0
    job = c.post("/v1/jobs", json={**GOOD, "queue": "q1"}).json()
    # What a dispatcher does on admission, and a retry after a lost worker, through the one state writer.
    runtime = c.app.state.runtime
    with Session(runtime.engine) as session:
        row = session.get(Job, job["id"])
        transition(session, row, to=JobState.STARTING, reason="admitted", values={"attempt": 1})
        transition(session, row, to=JobState.QUEUED, reason="worker_lost")
        session.commit()
    m = scrape()
    assert m["shunter_jobs"][(("queue", "q1"), ("state", "QUEUED"))] == 1
    assert m["shunter_jobs"][(("queue", "q1"), ("state", "RUNNING"))] == 0
    assert m["shunter_admissions_total"][()] == 1
    assert m["shunter_retries_total"][(("reason", "worker_lost"),)] == 1
    assert m["shunter_queue_wait_seconds_count"][()] == 1
    assert m["shunter_queue_wait_seconds_bucket"][(("le", "+Inf"),)] == 1
    latency = m["shunter_http_request_duration_seconds_count"]
    assert latency[(("method", "POST"), ("route", "/v1/jobs"), ("status", "201"))] == 1
    assert (("method", "GET"), ("route", "/metrics"), ("status", "200")) in latency


def test_cluster_view_from_the_snapshot(app_client: Callable[..., TestClient]) -> None:
    c = app_client()
    empty = c.get("/v1/cluster").json()
    assert empty["nodes"] == [] and empty["taken_at"] is None
    job = c.post("/v1/jobs", json=GOOD).json()
    with Session(c.app.state.runtime.engine) as session:
        session.add(ClusterSnapshot(id=1, dashboard_url="http://ray:8265", total={"CPU": 4.0}, available={"CPU": 2.0},
                                    nodes=[{"node_id": "n1", "address": "10.0.0.1", "alive": True,
                                            "total": {"CPU": 4.0}, "available": {"CPU": 2.0}}]))  # fmt: skip
        row = session.get(Job, job["id"])
        transition(session, row, to=JobState.STARTING, reason="admitted", values={"attempt": 1})
        session.commit()
    view = c.get("/v1/cluster").json()
    assert view["dashboard_url"] == "http://ray:8265" and view["nodes"][0]["node_id"] == "n1"
    assert view["available"] == {"CPU": 2.0}
    assert [(j["id"], j["resources"]) for j in view["jobs"]] == [(job["id"], {"CPU": 2.0})]
    assert view["jobs"][0]["ray_dashboard_url"] == f"http://ray:8265/#/jobs/shunter-{job['id']}-1"
