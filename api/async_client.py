"""`AsyncClient`: the REST API for asyncio programs (notebooks, services that submit jobs), with `Client`'s typed
answers (`api.schemas`) and retries (`api.retries`: GETs and submits, which carry an `Idempotency-Key`, after a
transient failure).

    async with AsyncClient("http://127.0.0.1:8080", token="...") as c:
        job = await c.submit_with_working_dir(spec, "./mycode")
        done = await c.wait(job.id)
        print(done.state, done.loss, await c.logs(job.id, tail=20))
"""

from __future__ import annotations

import asyncio
import builtins  # the classes' own `list` method shadows it in their annotations
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from tenacity import AsyncRetrying

from api import retries as retries_
from api.client import DEFAULT_EXCLUDES, TERMINAL, _checked, with_working_dir, working_dir_excludes, zipped
from api.schemas import ClusterPublic, EventPublic, JobList, JobPublic, SecretInfo, Validated


class AsyncClient:
    def __init__(self, base_url: str = "http://127.0.0.1:8080", *, token: str | None = None, timeout: float = 30.0,
                 retries: int = retries_.RETRIES):  # fmt: skip
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)
        self.retries = retries

    async def close(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def _request(self, method: str, path: str, *, repeat: bool | None = None, **kwargs: Any) -> httpx.Response:
        if not (repeat if repeat is not None else retries_.repeatable(method, kwargs.get("headers"))):
            return _checked(await self.http.request(method, path, **kwargs))
        async for attempt in AsyncRetrying(**retries_.policy(self.retries)):
            with attempt:
                return _checked(await self.http.request(method, path, **kwargs))
        raise AssertionError("unreachable: tenacity re-raises the last failure")

    async def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        r = await self._request(method, path, **kwargs)
        return r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text

    async def submit(self, spec: dict[str, Any], *, idempotency_key: str | None = None) -> JobPublic:
        """Queue a job; a retry after a lost answer returns the same job (its `Idempotency-Key`)."""
        headers = {"Idempotency-Key": idempotency_key or uuid.uuid4().hex}
        return JobPublic.model_validate(await self._call("POST", "/v1/jobs", json=spec, headers=headers))

    async def validate(self, spec: dict[str, Any]) -> Validated:
        """Every check a submission runs; nothing queued."""
        return Validated.model_validate(await self._call("POST", "/v1/jobs/validate", json=spec))

    async def upload_directory(self, directory: str | Path, *, excludes: Any = DEFAULT_EXCLUDES) -> dict[str, Any]:
        """Zip `directory` (in a thread: it reads files) and upload it; the answer's `uri` is a working_dir."""
        archive, _ = await asyncio.to_thread(zipped, directory, excludes=excludes)
        # An archive is stored by its content: sending it again stores nothing new.
        answer = await self._call("POST", "/v1/code", content=archive, headers={"Content-Type": "application/zip"},
                                  repeat=True)  # fmt: skip
        return dict(answer)

    async def submit_with_working_dir(
        self, spec: dict[str, Any], directory: str | Path, *, idempotency_key: str | None = None
    ) -> JobPublic:
        uri = (await self.upload_directory(directory, excludes=working_dir_excludes(spec)))["uri"]
        return await self.submit(with_working_dir(spec, uri), idempotency_key=idempotency_key)

    async def put_secret(self, name: str, value: str, *, scope: str = "owner", **holder: str) -> SecretInfo:
        """As `Client.put_secret`: keep a secret's value (a PUT replaces: safe to repeat)."""
        r = await self._request("PUT", f"/v1/secrets/{name}", params={"scope": scope, **holder},
                                json={"value": value}, repeat=True)  # fmt: skip
        return SecretInfo.model_validate(r.json())

    async def secrets(self) -> list[SecretInfo]:
        return [SecretInfo.model_validate(s) for s in await self._call("GET", "/v1/secrets")]

    async def get(self, job_id: str) -> JobPublic:
        return JobPublic.model_validate(await self._call("GET", f"/v1/jobs/{job_id}"))

    async def list(self, *, state: str | None = None, limit: int = 50, cursor: str | None = None,
                   **filters: str) -> JobList:  # fmt: skip
        params = {k: v for k, v in {"state": state, "limit": limit, "cursor": cursor, **filters}.items() if v}
        return JobList.model_validate(await self._call("GET", "/v1/jobs", params=params))

    async def cancel(self, job_id: str) -> dict[str, Any]:
        return dict(await self._call("POST", f"/v1/jobs/{job_id}/cancel"))

    async def events(self, job_id: str) -> builtins.list[EventPublic]:
        """Every event of the job, page after page."""
        out: list[EventPublic] = []
        params: dict[str, Any] = {}
        while True:
            r = await self._request("GET", f"/v1/jobs/{job_id}/events", params=params)
            out += [EventPublic.model_validate(e) for e in r.json()]
            after = r.headers.get("X-Next-After")
            if not after:
                return out
            params["after"] = after

    async def logs(self, job_id: str, *, attempt: int | None = None, tail: int | None = None) -> str:
        params = {k: v for k, v in {"attempt": attempt, "tail": tail}.items() if v is not None}
        return str(await self._call("GET", f"/v1/jobs/{job_id}/logs", params=params))

    async def cluster(self) -> ClusterPublic:
        return ClusterPublic.model_validate(await self._call("GET", "/v1/cluster"))

    async def wait(self, job_id: str, *, timeout: float = 600.0, interval: float = 0.5) -> JobPublic:
        """Poll until the job ends (SUCCEEDED, FAILED or CANCELLED)."""
        deadline = time.monotonic() + timeout
        while True:
            job = await self.get(job_id)
            if job.state in TERMINAL:
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job.state} after {timeout:.0f}s")
            await asyncio.sleep(interval)
