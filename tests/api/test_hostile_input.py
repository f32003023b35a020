"""Input that cannot lie (issue 12): over real HTTP, every hostile body is a 4xx naming what is wrong, never a 500.

- Resource amounts: a worker holding 0 CPU escaped admission and the queue's `max_cpus` (four 4-worker jobs entered
  a queue capped at 1 CPU); GPU 0 with use_gpu, negatives, booleans and numbers too large for a float are refused
  with the key named.
- Nesting: a config nested 600 deep was a 500 (pydantic cannot serialise it); a spec nests at most
  `max_spec_depth` levels.
- Size: a body over `max_body_bytes` is a 413 `too_large` on every route, counted while it is read: a client that
  lies in Content-Length, or sends a chunked body, is cut off at the bound.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi.testclient import TestClient

from api.app import create_app
from service.backends.ray_local import free_port
from service.runtime import Runtime
from tests.api.conftest import GOOD, offline_settings

LIMIT = 4096  # max_body_bytes in these tests (the smallest the settings allow is 1024)
JSON = {"content-type": "application/json"}
TOO_LARGE = {"detail": f"request body is larger than {LIMIT} bytes", "code": "too_large"}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[Callable[..., TestClient]]:
    """`client(**settings)`: a TestClient of the real app over a real SQLite file, with those settings."""
    opened: list[tuple[Runtime, TestClient]] = []

    def make(**overrides: Any) -> TestClient:
        home = tmp_path / str(len(opened))
        home.mkdir()
        runtime = Runtime.open(offline_settings(home, **overrides))
        test_client = TestClient(create_app(runtime=runtime), raise_server_exceptions=False)
        test_client.__enter__()
        opened.append((runtime, test_client))
        return test_client

    yield make
    for runtime, test_client in opened:
        test_client.__exit__(None, None, None)
        runtime.close()


def raw_job(**parts: str) -> bytes:
    """A job body with some members written as raw JSON text (1e999 and 400-digit numbers have no Python literal)."""
    members = ['"entrypoint": {"callable": "examples.mlp:train_loop"}'] + [f'"{k}": {v}' for k, v in parts.items()]
    return ("{" + ", ".join(members) + "}").encode()


def nested(depth: int) -> str:
    """A JSON array nested `depth` levels deep."""
    return "[" * depth + "]" * depth


# ---- resource amounts ----------------------------------------------------------------------------------------------
PER_WORKER = "resources.resources_per_worker"


@pytest.mark.parametrize(
    ("resources", "field"),
    [
        ('{"num_workers": 4, "resources_per_worker": {"CPU": 0}}', f"{PER_WORKER}.CPU"),  # the jobs
        ('{"resources_per_worker": {"CPU": 0.0}}', f"{PER_WORKER}.CPU"),
        ('{"resources_per_worker": {"CPU": 1e-9}}', f"{PER_WORKER}.CPU"),  # below Ray's 0.0001 step: holds nothing
        ('{"resources_per_worker": {"CPU": -1}}', f"{PER_WORKER}.CPU"),
        ('{"resources_per_worker": {"CPU": true}}', f"{PER_WORKER}.CPU"),  # not read as 1
        ('{"resources_per_worker": {"CPU": "2"}}', f"{PER_WORKER}.CPU"),
        ('{"resources_per_worker": {"CPU": 1' + "0" * 400 + "}}", f"{PER_WORKER}.CPU"),  # float() overflows
        ('{"use_gpu": true, "resources_per_worker": {"GPU": 0}}', f"{PER_WORKER}.GPU"),
        ('{"use_gpu": false, "resources_per_worker": {"GPU": 1}}', f"{PER_WORKER}.GPU"),
        ('{"resources_per_worker": {"custom_thing": -0.5}}', f"{PER_WORKER}.custom_thing"),
        ('{"resources_per_worker": {"memory": 1e999}}', f"{PER_WORKER}.memory"),
        ('{"resources_per_worker": {"memory": 1' + "0" * 400 + "}}", f"{PER_WORKER}.memory"),
        ('{"resources_per_worker": {"memory": -1}}', f"{PER_WORKER}.memory"),
        ('{"resources_per_worker": {"memory": "-1GiB"}}', f"{PER_WORKER}.memory"),
        ('{"resources_per_worker": {"memory": false}}', f"{PER_WORKER}.memory"),
    ],
)
def test_resource_amounts_that_lie_are_refused_with_the_key_named(
    client: Callable[..., TestClient], resources: str, field: str
) -> None:
    r = client().post("/v1/jobs", content=raw_job(resources=resources), headers=JSON)
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["code"] == "invalid_request" and body["field"] == field, body
    assert [e["field"] for e in body["errors"]] == [field]


def test_zero_cpu_workers_no_longer_slip_past_a_queue_capped_at_one_cpu(client: Callable[..., TestClient]) -> None:
    """The issue's report: four 4-worker jobs of CPU 0 all entered a queue with max_cpus 1."""
    c = client(queues={"capped": {"max_cpus": 1}})
    spec = {**GOOD, "queue": "capped", "resources": {"num_workers": 4, "resources_per_worker": {"CPU": 0}}}
    answers = [c.post("/v1/jobs", json=spec) for _ in range(4)]
    assert [a.status_code for a in answers] == [422] * 4
    assert c.get("/v1/jobs", params={"queue": "capped"}).json()["items"] == []


@pytest.mark.parametrize(
    "resources",
    [
        {"resources_per_worker": {"CPU": 0.5, "memory": "1GiB", "custom_thing": 0}},
        {"resources_per_worker": {"CPU": 0.0001}},
        {"use_gpu": True, "resources_per_worker": {"GPU": 0.25}},
        {"use_gpu": False, "resources_per_worker": {"GPU": 0}},  # no GPU, said twice
        {"resources_per_worker": {"memory": 2**40}},
    ],
)
def test_honest_amounts_still_pass(client: Callable[..., TestClient], resources: dict[str, Any]) -> None:
    r = client().post("/v1/jobs", json={**GOOD, "resources": resources})
    assert r.status_code == 201, r.text


def test_deepspeed_batch_size_of_infinity_is_a_422(client: Callable[..., TestClient]) -> None:
    strategy = '{"kind": "deepspeed", "deepspeed": {"config": {"train_batch_size": 1e999}}}'
    r = client().post("/v1/jobs", content=raw_job(strategy=strategy), headers=JSON)
    assert r.status_code == 422, r.text
    assert r.json()["field"] == "strategy.deepspeed.config.train_batch_size"


# ---- nesting ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("parts", "field"),
    [
        ({"config": '{"x": ' + nested(600) + "}"}, "config"),  # the body: a 500
        ({"config": '{"x": ' + nested(40) + "}"}, "config"),  # past the default 32, far below what breaks
        ({"config": '{"a": ' * 600 + "1" + "}" * 600}, "config"),
        ({"runtime_env": '{"config": ' + nested(100) + "}"}, "runtime_env"),
        ({"strategy": '{"kind": "deepspeed", "deepspeed": {"config": {"x": ' + nested(600) + "}}}"},
         "strategy.deepspeed.config"),
    ],
)  # fmt: skip
def test_deep_nesting_is_a_422_naming_the_field(
    client: Callable[..., TestClient], parts: dict[str, str], field: str
) -> None:
    r = client().post("/v1/jobs", content=raw_job(**parts), headers=JSON)
    assert r.status_code == 422, r.text[:300]
    assert r.json()["field"] == field, r.text[:300]
    assert "nested deeper than" in r.json()["detail"]


def test_nesting_limit_is_the_setting(client: Callable[..., TestClient]) -> None:
    """The request body is level 1, `config` level 2: with max_spec_depth 8, config may nest 7 levels."""
    c = client(max_spec_depth=8)
    fits = c.post("/v1/jobs", content=raw_job(config='{"x": ' + nested(6) + "}"), headers=JSON)
    assert fits.status_code == 201, fits.text
    deeper = c.post("/v1/jobs", content=raw_job(config='{"x": ' + nested(7) + "}"), headers=JSON)
    assert deeper.status_code == 422 and deeper.json()["field"] == "config", deeper.text
    assert "nested deeper than 8 levels" in deeper.json()["detail"]


def test_nesting_past_what_the_json_parser_takes_is_a_422(client: Callable[..., TestClient]) -> None:
    r = client().post("/v1/jobs", content=raw_job(config='{"x": ' + nested(200_000) + "}"), headers=JSON)
    assert r.status_code == 422, r.text[:300]


# ---- size ------------------------------------------------------------------------------------------------------
def big_job(size: int) -> bytes:
    """A valid job body of about `size` bytes."""
    return json.dumps({**GOOD, "config": {"pad": "x" * size}}).encode()


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/jobs"),
        ("PUT", "/v1/queues/q1"),
        ("POST", "/v1/jobs/jx/cancel"),
        ("GET", "/v1/jobs"),
        ("GET", "/healthz"),
        ("POST", "/internal/v1/attempts/jx/1/report"),
        ("POST", "/no/such/route"),
    ],
)
def test_a_body_over_the_limit_is_413_on_every_route(client: Callable[..., TestClient], method: str, path: str) -> None:
    r = client(max_body_bytes=LIMIT).request(method, path, content=big_job(LIMIT), headers=JSON)
    assert r.status_code == 413, r.text[:300]
    assert r.json() == TOO_LARGE


def test_a_body_at_the_limit_passes(client: Callable[..., TestClient]) -> None:
    c = client(max_body_bytes=LIMIT)
    body = big_job(LIMIT)
    body = big_job(LIMIT - (len(body) - LIMIT))
    assert len(body) == LIMIT
    assert c.post("/v1/jobs", content=body, headers=JSON).status_code == 201
    assert c.post("/v1/jobs", content=body + b" ", headers=JSON).status_code == 413


def test_a_lying_content_length_changes_nothing(client: Callable[..., TestClient]) -> None:
    """The declared length says 100; the body is 20 times the limit. Counted as read: 413, no job."""
    c = client(max_body_bytes=LIMIT)
    r = c.post("/v1/jobs", content=big_job(20 * LIMIT), headers={**JSON, "content-length": "100"})
    assert r.status_code == 413 and r.json() == TOO_LARGE
    assert c.get("/v1/jobs").json()["items"] == []


def test_the_code_upload_has_its_own_larger_bound(client: Callable[..., TestClient]) -> None:
    """POST /v1/code takes up to max_code_bytes: the general bound does not cut an archive off."""
    r = client(max_body_bytes=LIMIT).post("/v1/code", content=b"not a zip" * LIMIT)
    assert r.status_code == 422, r.text  # read whole and refused for what it is (no zip), not for its size


@pytest.fixture
def live(tmp_path: Path) -> Iterator[int]:
    """A real uvicorn server of the app (max_body_bytes = LIMIT) on a free port; yields the port."""
    runtime = Runtime.open(offline_settings(tmp_path, max_body_bytes=LIMIT))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(runtime=runtime), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    yield port
    server.should_exit = True
    thread.join(timeout=30)
    runtime.close()


def read_response(sock: socket.socket) -> tuple[int, dict[str, Any]]:
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _length(data):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body[: _length(data)])


def _length(data: bytes) -> int:
    for line in data.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def test_a_chunked_body_is_cut_off_at_the_limit_over_real_http(live: int) -> None:
    """No Content-Length at all: the client streams 1 KiB chunks and would go on for 1000 of them; the server answers
    413 once the bound is crossed, without waiting for (or reading) the rest."""
    chunk = b"x" * 1024
    with socket.create_connection(("127.0.0.1", live), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/jobs HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        sent = 0
        for _ in range(1000):
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sent += len(chunk)
            readable, _, _ = select.select([sock], [], [], 0.2)
            if readable:
                break
        status, body = read_response(sock)
    assert (status, body) == (413, TOO_LARGE)
    assert sent <= LIMIT + 2 * len(chunk), sent  # answered at the bound, not after the client's 1000 KiB


def test_an_honest_content_length_over_the_limit_is_refused_before_the_body(live: int) -> None:
    """The server answers on the headers alone: the client never sends a byte of the 100 MiB it announced."""
    with socket.create_connection(("127.0.0.1", live), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/jobs HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (100 << 20)
        )
        status, body = read_response(sock)
    assert (status, body) == (413, TOO_LARGE)
