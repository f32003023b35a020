"""Issue 12, item 5: follow streams are bounded and hold no database connection, logs are read in ranges and in
flat memory, the API opens only the log paths it builds from ids, and a database outage answers the documented 503.

Real parts only: live `shunter api` processes over real HTTP (the noop backend and no dispatcher, so a submitted job
stays QUEUED and its streams stay open), real SQLite files and real PostgreSQL databases; the app in-process where
this process's own memory is what is measured.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient
from sqlalchemy import text
from sqlmodel import Session

from api.app import create_app
from api.client import Client
from service.backends.noop import NoopJobs
from service.backends.ray_local import free_port
from service.config.settings import Settings
from service.core.backend import submission_id
from service.dispatch.host_files import HostFiles
from service.lifecycle.state import transition
from service.runtime import Runtime
from service.store.db import make_engine
from service.store.migrate import upgrade
from service.store.models import Attempt, Job, JobState, utcnow
from tests.api.conftest import GOOD, TOKENS, offline_settings
from tests.conftest import wait_for
from tests.service.conftest import PG_ADMIN_URL, fresh_pg_database

REPO = Path(__file__).resolve().parents[2]
ALICE = {"Authorization": "Bearer tok-alice"}
BOB = {"Authorization": "Bearer tok-bob"}


# --- a live `shunter api` process ------------------------------------------------------------------------------


@contextlib.contextmanager
def api_process(tmp_path: Path, database_url: str | None = None, **env: str) -> Iterator[str]:
    """`shunter api` (the HTTP API alone) on a free port, on the noop backend; yields its URL."""
    port = free_port()
    full = dict(os.environ)
    full.update(
        {
            "SHUNTER_DATABASE_URL": database_url or f"sqlite:///{tmp_path / 'shunter.db'}",
            "SHUNTER_DATA_DIR": str(tmp_path / "data"),
            "SHUNTER_BACKEND": f"noop:{tmp_path / 'noop'}",
            "SHUNTER_PORT": str(port),
            "SHUNTER_QUEUES": json.dumps({"default": {}}),
            "PYTHONUNBUFFERED": "1",
        }
    )
    full.pop("SHUNTER_API_TOKENS", None)
    full.update(env)
    log_path = tmp_path / f"api-{port}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "api.cli", "api"], env=full, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
            start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"shunter api exited {proc.returncode}: {log_path.read_text()[-3000:]}")
        try:
            return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(ready, timeout=60, what=f"shunter api on {url}")
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def drop_database(url: str) -> None:
    name = url.rsplit("/", 1)[1]
    admin = make_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE "{name}" WITH (FORCE)'))
    admin.dispose()


@contextlib.contextmanager
def follow_streams(http: httpx.Client, paths: list[str], headers: dict[str, str] | None = None) -> Iterator[list]:
    """Open one follow stream per path and hold them (each answered its status and headers); closed on exit."""
    with contextlib.ExitStack() as stack:
        opened = []
        for path in paths:
            response = stack.enter_context(http.stream("GET", path, params={"follow": "true"}, headers=headers))
            assert response.status_code == 200, (path, response.status_code, response.read())
            opened.append(response)
        yield opened


def stream_status(http: httpx.Client, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
    """Open a follow stream, read its status, headers and (for an error) body, and close it."""
    with http.stream("GET", path, params={"follow": "true", "timeout_seconds": 0.5}, headers=headers) as r:
        if r.status_code != 200:
            r.read()
        return r


# --- 1. streams: a cap per caller, no connection held, a maximum duration ---------------------------------------


def test_a_caller_may_hold_max_streams_per_caller_then_429(tmp_path: Path) -> None:
    tokens = json.dumps(TOKENS)
    with api_process(tmp_path, SHUNTER_API_TOKENS=tokens) as url, httpx.Client(base_url=url, timeout=10) as http:
        job = http.post("/v1/jobs", json=GOOD, headers=ALICE).json()["id"]
        kinds = [f"/v1/jobs/{job}/logs", f"/v1/jobs/{job}/events", "/v1/events"]
        with follow_streams(http, [kinds[i % 3] for i in range(8)], ALICE) as opened:
            for path in kinds:  # the 9th, of any kind
                ninth = stream_status(http, path, ALICE)
                assert ninth.status_code == 429, (path, ninth.status_code)
                assert int(ninth.headers["Retry-After"]) > 0
                body = ninth.json()
                assert body["code"] == "too_many_streams" and "8" in body["detail"], body
            # The cap is per caller: bob still streams; plain requests still answer.
            assert stream_status(http, "/v1/events", BOB).status_code == 200
            assert http.get("/v1/jobs", headers=ALICE).status_code == 200
            # A stream the client closes gives its slot back.
            opened[0].close()
            wait_for(lambda: stream_status(http, kinds[0], ALICE).status_code == 200, timeout=10, what="a freed slot")


@pytest.mark.parametrize("database", ["sqlite", "postgres"])
def test_many_streams_do_not_starve_other_requests(tmp_path: Path, database: str) -> None:
    """24 follow streams of one caller (the cap raised), more than the engine's pool (15 + 5 on PostgreSQL, 5 + 10
    on SQLite): requests still answer, well before the pool's 30 s checkout timeout a held pool would make them wait
    for, because no stream holds a connection between its polls."""
    with contextlib.ExitStack() as stack:
        db_url = stack.enter_context(fresh_pg_database()) if database == "postgres" else None
        url = stack.enter_context(api_process(tmp_path, db_url, SHUNTER_MAX_STREAMS_PER_CALLER="64"))
        http = stack.enter_context(httpx.Client(base_url=url, timeout=httpx.Timeout(10.0)))
        job = http.post("/v1/jobs", json=GOOD).json()["id"]
        paths = [f"/v1/jobs/{job}/logs"] * 10 + [f"/v1/jobs/{job}/events"] * 10 + ["/v1/events"] * 4
        with follow_streams(http, paths):
            time.sleep(1.5)  # every stream has polled the database a few times
            for _ in range(5):
                started = time.monotonic()
                r = http.get("/v1/jobs", timeout=15)
                elapsed = time.monotonic() - started
                assert r.status_code == 200 and elapsed < 10.0, (r.status_code, f"{elapsed:.2f}s")
            started = time.monotonic()
            assert http.post("/v1/jobs", json=GOOD, timeout=15).status_code == 201
            assert time.monotonic() - started < 10.0


def test_every_stream_ends_at_the_maximum_duration(tmp_path: Path) -> None:
    """A QUEUED job's streams would never end by themselves (no dispatcher): they end at stream_max_seconds, also
    when the caller asked for longer."""
    with api_process(tmp_path, SHUNTER_STREAM_MAX_SECONDS="2") as url, httpx.Client(base_url=url) as http:
        job = http.post("/v1/jobs", json=GOOD).json()["id"]
        for path, params in [
            (f"/v1/jobs/{job}/logs", {}),
            (f"/v1/jobs/{job}/events", {}),
            ("/v1/events", {}),
            ("/v1/events", {"timeout_seconds": 3600}),
        ]:
            started = time.monotonic()
            r = http.get(path, params={"follow": "true", **params}, timeout=httpx.Timeout(10.0))
            elapsed = time.monotonic() - started
            assert r.status_code == 200 and 1.5 < elapsed < 6.0, (path, params, f"{elapsed:.2f}s")
        # The streams that ended gave their slots back: the whole cap is free again.
        with follow_streams(http, ["/v1/events"] * 8):
            pass


# --- 2. logs: ranged, in flat memory; follow shares one Ray fetch -------------------------------------------


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


def _ended_attempt(runtime: Runtime, job_id: str, *, log_uri: str | None = None) -> None:
    """What a dispatcher leaves after a job's one attempt: the job ended on attempt 1, the attempt row ended."""
    with Session(runtime.engine) as session:
        job = session.get(Job, job_id)
        assert job is not None
        transition(session, job, to=JobState.STARTING, reason="admitted", values={"attempt": 1})
        session.add(Attempt(job_id=job_id, number=1, submission_id=submission_id(job_id, 1), submitted=True,
                            ended_at=utcnow() + timedelta(seconds=1), log_uri=log_uri))  # fmt: skip
        transition(session, job, to=JobState.FAILED, reason="user_error")
        session.commit()


def _running_attempt(runtime: Runtime, job_id: str) -> str:
    """What a dispatcher writes before it submits an attempt: the job STARTING on attempt 1, its row not ended."""
    with Session(runtime.engine) as session:
        job = session.get(Job, job_id)
        assert job is not None
        transition(session, job, to=JobState.STARTING, reason="admitted", values={"attempt": 1})
        session.add(Attempt(job_id=job_id, number=1, submission_id=submission_id(job_id, 1)))
        session.commit()
    return submission_id(job_id, 1)


def test_a_running_attempts_log_is_empty_until_submitted_and_503_only_while_ray_is_away(
    app_client: Callable[..., TestClient], tmp_path: Path
) -> None:
    """The attempt's row is written before its submission: a read in between gets its log as it is, empty (a 503
    there was a server error seen by schemathesis' stateful run). Only a Ray that does not answer is a 503."""
    (tmp_path / "noop-api").mkdir()  # its own database: app_client's is in tmp_path
    settings = offline_settings(tmp_path / "noop-api", backend=f"noop:{tmp_path / 'noop'}")
    runtime = Runtime.open(settings)
    try:
        with TestClient(create_app(runtime=runtime), raise_server_exceptions=False) as c:
            job = c.post("/v1/jobs", json=GOOD).json()["id"]
            sid = _running_attempt(runtime, job)
            r = c.get(f"/v1/jobs/{job}/logs")
            assert (r.status_code, r.content, r.headers["X-Next-Offset"]) == (200, b"", "0")
            with c.stream("GET", f"/v1/jobs/{job}/logs", params={"follow": "true", "timeout_seconds": 1}) as stream:
                assert stream.status_code == 200 and stream.read() == b""
            runtime.ray.submit(submission_id=sid, entrypoint="x", runtime_env={}, metadata={})
            # Seen once the shared view is older than its poll (one second).
            wait_for(lambda: c.get(f"/v1/jobs/{job}/logs").text == f"noop job {sid}\n", timeout=10)
    finally:
        runtime.close()
    away = app_client()  # Ray at a closed port
    job = away.post("/v1/jobs", json=GOOD).json()["id"]
    _running_attempt(away.app.state.runtime, job)
    r = away.get(f"/v1/jobs/{job}/logs")
    assert r.status_code == 503 and r.json()["code"] == "unavailable", r.text
    assert "does not answer" in r.json()["detail"]


def test_a_1gib_log_is_served_by_range_in_flat_memory(app_client: Callable[..., TestClient]) -> None:
    c = app_client()
    runtime: Runtime = c.app.state.runtime
    job = c.post("/v1/jobs", json=GOOD).json()["id"]
    _ended_attempt(runtime, job)
    path = HostFiles(runtime.settings.data_dir).log_path(job, 1)
    path.parent.mkdir(parents=True)
    head = b"".join(b"first %d\n" % i for i in range(5))
    last = b"".join(b"line %d\n" % i for i in range(20))
    size = 1 << 30
    with open(path, "wb") as f:  # sparse: 1 GiB in a moment, and no disk
        f.write(head)
        f.truncate(size)
        f.seek(size - len(last))
        f.write(last)

    peak_reset = True
    try:
        Path("/proc/self/clear_refs").write_text("5")  # restart VmHWM from now
    except OSError:
        peak_reset = False
    before = _status_kib("VmRSS")

    r = c.get(f"/v1/jobs/{job}/logs", params={"tail": 10})
    assert r.status_code == 200 and r.content == b"".join(b"line %d\n" % i for i in range(10, 20))
    assert r.headers["X-Next-Offset"] == str(size)
    r = c.get(f"/v1/jobs/{job}/logs", params={"offset": size - len(last), "limit_bytes": 14})
    assert r.content == b"line 0\nline 1\n" and r.headers["X-Next-Offset"] == str(size - len(last) + 14)
    r = c.get(f"/v1/jobs/{job}/logs", params={"offset": r.headers["X-Next-Offset"], "tail": 2, "limit_bytes": 7})
    assert r.content == b"line 18"  # the last 2 lines, cut at 7 bytes
    r = c.get(f"/v1/jobs/{job}/logs", params={"limit_bytes": len(head)})
    assert r.content == head and r.headers["X-Next-Offset"] == str(len(head))
    r = c.get(f"/v1/jobs/{job}/logs", params={"offset": size + 5})
    assert r.content == b"" and r.headers["X-Next-Offset"] == str(size)

    growth_mib = ((_status_kib("VmHWM") if peak_reset else _status_kib("VmRSS")) - before) / 1024
    assert growth_mib < 50, f"serving a 1 GiB log by range grew this process by {growth_mib:.0f} MiB"


def test_log_ranges_and_tails(app_client: Callable[..., TestClient]) -> None:
    """Before an attempt: empty, offset 0. `tail` counts lines; a final newline ends the last line."""
    c = app_client()
    runtime: Runtime = c.app.state.runtime
    job = c.post("/v1/jobs", json=GOOD).json()["id"]
    r = c.get(f"/v1/jobs/{job}/logs", params={"tail": 3})
    assert r.status_code == 200 and r.content == b"" and r.headers["X-Next-Offset"] == "0"
    _ended_attempt(runtime, job)
    path = HostFiles(runtime.settings.data_dir).log_path(job, 1)
    path.parent.mkdir(parents=True)
    path.write_bytes("a\nb\nc\ndé\n".encode())
    assert c.get(f"/v1/jobs/{job}/logs", params={"tail": 2}).text == "c\ndé\n"
    assert c.get(f"/v1/jobs/{job}/logs", params={"tail": 99}).text == "a\nb\nc\ndé\n"
    assert c.get(f"/v1/jobs/{job}/logs").text == "a\nb\nc\ndé\n"
    path.write_bytes(b"a\nb\nno newline")
    assert c.get(f"/v1/jobs/{job}/logs", params={"tail": 1}).text == "no newline"
    assert c.get(f"/v1/jobs/{job}/logs", params={"tail": 2, "follow": "true"}).text == "b\nno newline"
    assert c.get(f"/v1/jobs/{job}/logs", params={"offset": 4, "follow": "true"}).text == "no newline"
    assert c.get(f"/v1/jobs/{job}/logs", params={"tail": 0}).status_code == 422


class GrowingNoop(NoopJobs):
    """The noop backend, but its jobs keep running and their log grows a line every 50 ms; it counts how often a
    log is fetched (what Ray's Jobs API would be asked)."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory, run_seconds=3600)
        self.fetches = 0
        self.started = time.monotonic()
        self._lock = threading.Lock()

    def text(self, lines: int) -> str:
        return "".join(f"step {i}\n" for i in range(lines))

    def logs(self, submission_id: str) -> str | None:
        with self._lock:
            self.fetches += 1
        return self.text(int((time.monotonic() - self.started) / 0.05))


def test_followers_share_one_ray_fetch_per_poll(tmp_path: Path) -> None:
    """Five followers of one running attempt for ~3 s: Ray's log is fetched about once a second in all (not five
    times), and each follower gets every line once, in order."""
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'api.db'}", data_dir=tmp_path / "data",
                        queues={"default": {}})  # fmt: skip
    engine = make_engine(settings.database_url)
    upgrade(engine)
    backend = GrowingNoop(tmp_path / "noop")
    runtime = Runtime(settings=settings, engine=engine, ray=backend)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(runtime=runtime), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, timeout=30, what="uvicorn")
        url = f"http://127.0.0.1:{port}"
        job = httpx.post(f"{url}/v1/jobs", json=GOOD).json()["id"]
        with Session(engine) as session:
            row = session.get(Job, job)
            assert row is not None
            transition(session, row, to=JobState.STARTING, reason="admitted", values={"attempt": 1})
            session.add(Attempt(job_id=job, number=1, submission_id=submission_id(job, 1), submitted=True))
            session.commit()

        received: list[bytes] = [b""] * 5

        def follow(i: int) -> None:
            until = time.monotonic() + 3
            with httpx.stream("GET", f"{url}/v1/jobs/{job}/logs", params={"follow": "true", "timeout_seconds": 3},
                              timeout=10) as r:  # fmt: skip
                assert r.status_code == 200
                for chunk in r.iter_bytes():
                    received[i] += chunk
                    if time.monotonic() > until:
                        break  # (the stream also ends by itself at timeout_seconds)

        before = backend.fetches
        followers = [threading.Thread(target=follow, args=(i,)) for i in range(5)]
        for t in followers:
            t.start()
        for t in followers:
            t.join(timeout=20)
            assert not t.is_alive()
        fetches = backend.fetches - before
        assert 2 <= fetches <= 6, f"{fetches} fetches of the Ray log for 5 followers over 3 s"
        for got in received:
            lines = got.decode().count("\n")
            assert lines >= 20 and got.decode() == backend.text(lines), got[-200:]
        # A running attempt's tail (from Ray's log), through the client and the CLI.
        with Client(url) as client:
            last_two = client.logs(job, tail=2).splitlines()
        assert len(last_two) == 2 and int(last_two[1].split()[1]) == int(last_two[0].split()[1]) + 1
        cli = subprocess.run([sys.executable, "-m", "api.cli", "logs", job, "--tail", "3", "--server", url],
                             capture_output=True, text=True, timeout=60, cwd=REPO, check=True)  # fmt: skip
        assert len(cli.stdout.splitlines()) == 3 and cli.stdout.startswith("step "), cli.stdout
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        engine.dispose()


# --- 3. the API opens only paths it builds from ids ---------------------------------------------------------------


def test_a_log_uri_in_the_database_is_never_opened(app_client: Callable[..., TestClient], tmp_path: Path) -> None:
    secret = tmp_path / "outside" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("SECRET=hunter2\n")
    c = app_client()
    runtime: Runtime = c.app.state.runtime
    job = c.post("/v1/jobs", json=GOOD).json()["id"]
    _ended_attempt(runtime, job, log_uri=str(secret))  # a row that names a file outside the data dir

    for params in ({}, {"attempt": 1}, {"tail": 5}, {"follow": "true"}, {"follow": "true", "attempt": 1}):
        r = c.get(f"/v1/jobs/{job}/logs", params=params)
        assert r.status_code == 200 and "hunter2" not in r.text, (params, r.text)
    # What the endpoint reads is the copy where the dispatcher keeps it, named by job id and attempt number.
    kept = HostFiles(runtime.settings.data_dir).keep_log(job, 1, "the real log\n")
    assert Path(kept).resolve().is_relative_to(runtime.settings.data_dir.resolve())
    assert c.get(f"/v1/jobs/{job}/logs").text == "the real log\n"
    assert c.get(f"/v1/jobs/{job}/logs", params={"follow": "true"}).text == "the real log\n"


# --- 4. a database outage is the documented 503 -------------------------------------------------------------------


def test_a_database_outage_answers_503_with_retry_after(tmp_path: Path) -> None:
    """A live `shunter api` on a fresh PostgreSQL database, which is then dropped under it."""
    with (
        fresh_pg_database() as db_url,
        api_process(tmp_path, db_url) as url,
        httpx.Client(base_url=url, timeout=30) as http,
    ):
        job = http.post("/v1/jobs", json=GOOD).json()["id"]
        assert http.get(f"/v1/jobs/{job}").status_code == 200
        drop_database(db_url)
        for method, path, body in [
            ("GET", "/v1/jobs", None),
            ("GET", f"/v1/jobs/{job}", None),
            ("GET", f"/v1/jobs/{job}/logs", None),
            ("GET", "/v1/events", None),
            ("POST", "/v1/jobs", GOOD),
            ("POST", f"/v1/jobs/{job}/cancel", None),
        ]:
            r = http.request(method, path, json=body)
            assert r.status_code == 503, (method, path, r.status_code, r.text)
            assert int(r.headers["Retry-After"]) > 0
            assert r.json()["code"] == "unavailable" and "Traceback" not in r.text
        assert http.get("/readyz").status_code == 503
        # A follow stream opened during the outage rides it out and ends at its deadline, without a 500.
        r = http.get("/v1/events", params={"follow": "true", "timeout_seconds": 1})
        assert r.status_code == 200
