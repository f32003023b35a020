"""A real shunter API (uvicorn, real HTTP on a free loopback port) in a thread, over a database a test owns: what a
job's driver, Train controller and workers report to, without a whole `shunter serve`."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from sqlalchemy.engine import Engine
from sqlmodel import Session

from api.app import create_app
from service.backends.noop import NoopJobs
from service.backends.ray_local import free_port
from service.config.settings import Settings
from service.runtime import Runtime
from service.store.models import Attempt, Job
from service.tenancy import attempt_tokens
from workers.attempt_api import AttemptApi


@dataclass
class LiveApi:
    url: str
    engine: Engine
    settings: Settings

    def token(self, job_id: str, attempt: int) -> str:
        return attempt_tokens.issue(job_id, attempt, attempt_tokens.keys_for(self.engine, self.settings).current)

    def attempt_api(self, job_id: str, attempt: int = 1) -> AttemptApi:
        return AttemptApi(url=self.url, token=self.token(job_id, attempt), job_id=job_id, attempt=attempt)

    def job_env(self, job_id: str, attempt: int = 1) -> dict[str, str]:
        """The env vars the dispatcher gives an attempt, for a Ray Train run started by the test itself."""
        return {"SHUNTER_PROGRESS_URL": self.url, "SHUNTER_ATTEMPT_TOKEN": self.token(job_id, attempt),
                "SHUNTER_JOB_ID": job_id, "SHUNTER_ATTEMPT": str(attempt)}  # fmt: skip


def add_attempt(engine: Engine, job: Job) -> None:
    """The job row, and its current attempt's row (the dispatcher makes one when it admits an attempt)."""
    with Session(engine) as session:
        session.add(job)
        session.commit()
        if job.attempt:
            session.add(Attempt(job_id=job.id, number=job.attempt, submission_id=f"shunter-{job.id}-{job.attempt}"))
            session.commit()
        session.refresh(job)


@contextmanager
def live_api(
    engine: Engine, tmp_path: Path, *, port: int | None = None, ray: Any = None, **settings: object
) -> Iterator[LiveApi]:
    """The API over `engine`, on the noop backend unless given a `ray` backend."""
    settings.setdefault("storage_uri", str(tmp_path / "storage"))  # not ./shunter-data in the working directory
    conf = Settings(database_url=str(engine.url), data_dir=tmp_path / "api-data", **settings)  # type: ignore[arg-type]
    runtime = Runtime(settings=conf, engine=engine, ray=NoopJobs(tmp_path / "noop") if ray is None else ray)
    port = port or free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(runtime=runtime),
            host="127.0.0.1",
            port=port,
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=2,
        )  # open follow streams are cut, not awaited
    )
    thread = threading.Thread(target=server.run, name="live-api", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise AssertionError("the live API did not start")
        time.sleep(0.05)
    assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200
    try:
        yield LiveApi(url=url, engine=engine, settings=conf)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
