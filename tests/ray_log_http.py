"""Ray's HTTP surfaces for one driver log, for the quick tier (which has no Ray): what `service.backends.driver_logs`
reads.

- the dashboard's record of a Ray Job, `GET /api/jobs/<submission id>`, naming the driver's agent as Ray does
  (`driver_agent_http_address`, `driver_node_id`);
- the dashboard's whole-log read, `GET /api/jobs/<id>/logs`, answered as Ray answers it: the whole file in one JSON
  string (what shunter called before issue 35);
- the head's state API, `GET /api/v0/logs/file`, streaming the file from its first byte (`lines=-1`);
- the agent's `/logs/` route: aiohttp's static file route, the very handler Ray's dashboard agent registers for its
  log directory (`ray.dashboard.modules.log.log_agent.LogAgent`: `routes.static("/logs", log_dir)`), which answers
  `Range` requests with 206.

Each surface counts the bytes of the log it sent, so a test can tell a ranged read from a whole one. The real
surfaces, on a real Ray head, are read in tests/api/test_live_service.py (slow tier).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from service.backends.ray_local import free_port


@dataclass
class RayLogHttp:
    dashboard_url: str
    agent_url: str
    log_dir: Path
    jobs: dict[str, str] = field(default_factory=dict)  # submission id -> its Ray status
    sent: Counter[str] = field(default_factory=Counter)  # bytes of logs sent, by surface

    def log_path(self, submission_id: str) -> Path:
        return self.log_dir / f"job-driver-{submission_id}.log"


def _dashboard(state: RayLogHttp) -> web.Application:
    async def job(request: web.Request) -> web.Response:
        sid = request.match_info["sid"]
        if sid not in state.jobs:
            return web.Response(status=404, text=f"Job {sid} does not exist")
        record = {"submission_id": sid, "status": state.jobs[sid], "job_id": "02000000", "driver_node_id": "ab" * 28,
                  "driver_agent_http_address": state.agent_url}  # fmt: skip
        return web.json_response(record)

    async def whole(request: web.Request) -> web.Response:
        sid = request.match_info["sid"]
        if sid not in state.jobs:
            return web.Response(status=404, text=f"Job {sid} does not exist")
        text = state.log_path(sid).read_text()
        state.sent["jobs_api"] += len(text.encode())
        return web.Response(text=json.dumps({"logs": text}), content_type="application/json")

    async def state_api(request: web.Request) -> web.StreamResponse:
        name = request.query.get("filename") or f"job-driver-{request.query['submission_id']}.log"
        path = state.log_dir / name
        if request.query.get("lines") != "-1" or not path.is_file():
            return web.Response(status=500, text="this stand-in streams whole files only")
        response = web.StreamResponse()
        response.content_type = "text/plain"
        await response.prepare(request)
        with open(path, "rb") as f:
            while chunk := f.read(64 * 1024):
                await response.write(chunk)
                state.sent["state_api"] += len(chunk)
        await response.write_eof()
        return response

    app = web.Application()
    app.add_routes([web.get("/api/jobs/{sid}", job), web.get("/api/jobs/{sid}/logs", whole),
                    web.get("/api/v0/logs/file", state_api)])  # fmt: skip
    return app


def _agent(state: RayLogHttp) -> web.Application:
    async def counted(request: web.Request, response: web.StreamResponse) -> None:
        if request.path.startswith("/logs/") and response.content_length:
            state.sent["agent"] += response.content_length

    app = web.Application()
    app.add_routes([web.static("/logs", state.log_dir)])
    app.on_response_prepare.append(counted)
    return app


@contextmanager
def ray_log_http(log_dir: Path, *, agent_listening: bool = True) -> Iterator[RayLogHttp]:
    """The surfaces above on loopback, in a thread; with `agent_listening=False` the agent's port takes no connection
    (an agent this host cannot reach)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    dashboard_port, agent_port = free_port(), free_port()
    state = RayLogHttp(f"http://127.0.0.1:{dashboard_port}", f"http://127.0.0.1:{agent_port}", log_dir)
    loop = asyncio.new_event_loop()
    runners: list[web.AppRunner] = []

    async def start() -> None:
        apps = [(_dashboard(state), dashboard_port)] + ([(_agent(state), agent_port)] if agent_listening else [])
        for app, port in apps:
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            runners.append(runner)

    thread = threading.Thread(target=loop.run_forever, name="ray-log-http", daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=30)
    try:
        yield state
    finally:

        async def stop() -> None:
            for runner in runners:
                await runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
