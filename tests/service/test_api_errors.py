"""Bad input over the real app and a real SQLite file: 4xx JSON naming the field, never a 500 or a traceback.

These requests never reach Ray (the API does not call it on these paths); the Ray adapter points at a closed port.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from service.config.settings import Settings
from service.runtime import Runtime

GOOD = {"entrypoint": {"callable": "examples.mlp:train_loop"}, "resources": {"num_workers": 2}}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'api.db'}",
        ray_address="127.0.0.1:9",
        ray_dashboard_url="http://127.0.0.1:9",
    )
    runtime = Runtime.open(settings)
    with TestClient(create_app(runtime=runtime), raise_server_exceptions=False) as c:
        yield c
    runtime.close()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({**GOOD, "unknown_field": 1}, "unknown_field"),
        ({**GOOD, "resources": {"num_workers": 0}}, "resources.num_workers"),
        ({**GOOD, "resources": {"num_workers": -1}}, "resources.num_workers"),
        ({**GOOD, "resources": {"num_workers": {"min": 3, "max": 1}}}, "resources.num_workers.max"),
        ({**GOOD, "resources": {"num_workers": {"min": 0, "max": 2}}}, "resources.num_workers.min"),
        ({**GOOD, "resources": {"num_workers": {"max": 2}}}, "resources.num_workers.min"),
        ({**GOOD, "resources": {"num_workers": True}}, "resources.num_workers"),
        ({**GOOD, "entrypoint": {"callable": "not-a-callable"}}, "entrypoint.callable"),
        ({**GOOD, "strategy": {"kind": "horovod"}}, "strategy.kind"),
        ({**GOOD, "strategy": {"mixed_precision": "bf16"}}, "strategy.mixed_precision"),
        ({"resources": {"num_workers": 1}}, "entrypoint"),
    ],
)
def test_bad_spec_is_422_naming_the_field(client: TestClient, body: dict, field: str) -> None:
    r = client.post("/v1/jobs", json=body)
    assert r.status_code == 422, r.text
    data = r.json()
    assert any(e["field"] == field for e in data["errors"]), data
    assert "Traceback" not in r.text
    assert client.get("/v1/jobs").json()["items"] == []  # nothing queued


def test_not_json_is_422(client: TestClient) -> None:
    r = client.post("/v1/jobs", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["code"] == "invalid_request"


def test_unknown_job_is_404_json(client: TestClient) -> None:
    for path in ("/v1/jobs/nope", "/v1/jobs/nope/events", "/v1/jobs/nope/logs", "/v1/jobs/nope/checkpoints"):
        r = client.get(path)
        assert r.status_code == 404 and r.json() == {"detail": "no job 'nope'", "code": "not_found"}
    assert client.post("/v1/jobs/nope/cancel").status_code == 404


def test_cancel_of_queued_then_ended_job(client: TestClient) -> None:
    job = client.post("/v1/jobs", json=GOOD).json()
    assert job["state"] == "QUEUED"
    r = client.post(f"/v1/jobs/{job['id']}/cancel")
    assert r.status_code == 202 and r.json()["state"] == "CANCELLED"
    again = client.post(f"/v1/jobs/{job['id']}/cancel")
    assert again.status_code == 409 and again.json()["code"] == "conflict"
    events = client.get(f"/v1/jobs/{job['id']}/events").json()
    assert [(e["from_state"], e["to_state"]) for e in events] == [(None, "QUEUED"), ("QUEUED", "CANCELLED")]


def test_list_filters_and_pages(client: TestClient) -> None:
    ids = [client.post("/v1/jobs", json={**GOOD, "name": f"j{i}"}).json()["id"] for i in range(5)]
    page1 = client.get("/v1/jobs", params={"limit": 2}).json()
    page2 = client.get("/v1/jobs", params={"limit": 2, "cursor": page1["next_cursor"]}).json()
    page3 = client.get("/v1/jobs", params={"limit": 2, "cursor": page2["next_cursor"]}).json()
    seen = [j["id"] for j in page1["items"] + page2["items"] + page3["items"]]
    assert seen == list(reversed(ids)) and page3["next_cursor"] is None
    assert client.get("/v1/jobs", params={"state": "RUNNING"}).json()["items"] == []
    assert client.get("/v1/jobs", params={"state": "NOPE"}).status_code == 422
    assert client.get("/v1/jobs", params={"cursor": "garbage!"}).status_code == 422


def test_health_and_readiness(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    r = client.get("/readyz")
    assert r.status_code == 503 and r.json()["checks"] == {"database": True, "ray": False}
    assert client.get("/docs").status_code == 200
    assert "/v1/jobs" in client.get("/openapi.json").json()["paths"]
