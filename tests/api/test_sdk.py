"""Issue 38, item 3: the SDK tries again what is safe to repeat, after what is transient, and nothing else.

Real HTTP throughout: a live API (tests/live_api.py) behind a small real proxy (uvicorn) that fails requests as
told: `503` (answered without reaching the API), `lose` (the API acts, then the answer is lost: a 503 instead), or
`429` with Retry-After. `Client` and `AsyncClient` alike."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from api.async_client import AsyncClient
from api.client import ApiError, Client
from service.backends.ray_local import free_port
from service.store.db import make_engine
from service.store.migrate import upgrade
from tests.api.conftest import GOOD
from tests.conftest import in_a_loop_of_its_own
from tests.live_api import live_api


class Flaky:
    """A proxy to `target` that fails the next requests as `plan` says, and counts what it was sent."""

    def __init__(self, target: str) -> None:
        self.target, self.plan, self.seen = target, [], []
        self.http = httpx.Client(base_url=target, timeout=30)

    async def handle(self, request: Request) -> Response:
        body = await request.body()
        self.seen.append(f"{request.method} {request.url.path}")
        action = self.plan.pop(0) if self.plan else "pass"
        if action == "503":
            return JSONResponse({"detail": "unavailable", "code": "unavailable"}, status_code=503)
        if action == "429":
            return JSONResponse({"detail": "slow down"}, status_code=429, headers={"Retry-After": "1"})
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        answer = await asyncio.to_thread(self.http.request, request.method, request.url.path,
                                         params=request.query_params, content=body, headers=headers)  # fmt: skip
        if action == "lose":
            return JSONResponse({"detail": "the answer was lost"}, status_code=503)
        keep = {k: v for k, v in answer.headers.items() if k.lower() in ("content-type", "x-next-after")}
        return Response(answer.content, status_code=answer.status_code, headers=keep)


@contextmanager
def flaky_proxy(target: str) -> Iterator[tuple[str, Flaky]]:
    flaky = Flaky(target)
    app = Starlette(routes=[Route("/{path:path}", flaky.handle, methods=["GET", "POST", "PUT", "DELETE"])])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", flaky
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture
def proxied(tmp_path: Path) -> Iterator[tuple[str, Flaky, str]]:
    engine = make_engine(f"sqlite:///{tmp_path / 'api.db'}")
    upgrade(engine)
    with live_api(engine, tmp_path) as api, flaky_proxy(api.url) as (url, flaky):
        yield url, flaky, api.url
    engine.dispose()


def test_the_client_retries_gets_and_submits_only_after_transient_failures(proxied: tuple[str, Flaky, str]) -> None:
    url, flaky, direct = proxied
    with Client(url) as c, Client(direct) as truth:
        flaky.plan = ["503", "503"]
        assert c.list().items == [] and flaky.seen == ["GET /v1/jobs"] * 3
        flaky.plan, flaky.seen = ["lose"], []
        job = c.submit(GOOD)  # the first POST queued it; its answer was lost; the retry is answered the same job
        assert flaky.seen == ["POST /v1/jobs"] * 2 and [j.id for j in truth.list().items] == [job.id]
        flaky.plan, flaky.seen = ["503"], []
        with pytest.raises(ApiError) as once:
            c.cancel(job.id)  # a POST without an Idempotency-Key: tried once
        assert once.value.status_code == 503 and flaky.seen == [f"POST /v1/jobs/{job.id}/cancel"]
        flaky.plan, flaky.seen = ["429"], []
        started = time.monotonic()
        assert c.get(job.id).id == job.id and time.monotonic() - started >= 1.0  # the server's Retry-After
        flaky.plan, flaky.seen = ["503"] * 10, []
        with pytest.raises(ApiError):
            Client(url, retries=2).get(job.id)
        assert len(flaky.seen) == 3  # retries=2: three tries in all
        flaky.plan, flaky.seen = [], []
        with pytest.raises(ApiError) as not_found:
            c.get("jnope")  # a 404 is the answer, not a failure: never retried
        assert not_found.value.status_code == 404 and len(flaky.seen) == 1


def test_the_async_client_does_the_same(proxied: tuple[str, Flaky, str], tmp_path: Path) -> None:
    url, flaky, direct = proxied
    code = tmp_path / "code"
    code.mkdir()
    (code / "mytrain.py").write_text("def train_loop(config):\n    pass\n")

    async def scenario() -> None:
        async with AsyncClient(url) as c:
            flaky.plan = ["503"]
            assert (await c.list()).items == []
            flaky.plan = ["lose"]
            job = await c.submit_with_working_dir(GOOD, code)
            assert job.spec["runtime_env"]["working_dir"].endswith(".zip")
            assert [e.reason for e in await c.events(job.id)] == ["submitted"]
            assert (await c.validate(GOOD)).valid
            assert (await c.cancel(job.id)) and (await c.wait(job.id, timeout=30)).state == "CANCELLED"
            flaky.plan = ["lose"]  # a PUT of a secret replaces: its lost answer is asked again
            kept = await c.put_secret("HF_TOKEN", "hf_" + "v" * 16)
            assert (kept.name, kept.scope) == ("HF_TOKEN", "owner")
            assert [s.name for s in await c.secrets()] == ["HF_TOKEN"]

    in_a_loop_of_its_own(scenario)
    with Client(direct) as truth:
        assert len(truth.list().items) == 1  # the lost answer's retry made no second job
