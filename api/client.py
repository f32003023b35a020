"""A typed Python client of the v1 API (httpx); the CLI and the tests use it."""

from __future__ import annotations

import builtins  # the classes' own `list` method shadows it in their annotations
import fnmatch
import os
import tempfile
import time
import uuid
import zipfile
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import httpx
import pathspec
from tenacity import Retrying

from api import retries as retries_
from api.schemas import (
    AttemptPublic,
    CheckpointPublic,
    ClusterPublic,
    EventPublic,
    JobList,
    JobPublic,
    MetricPoint,
    SecretInfo,
    UsagePublic,
    Validated,
)
from api.sweep_schemas import SweepCancelled, SweepList, SweepPublic


class ApiError(Exception):
    """A 4xx/5xx answer; carries the server's JSON body."""

    def __init__(self, status_code: int, body: dict[str, Any], retry_after: float | None = None) -> None:
        self.status_code = status_code
        self.body = body
        self.code = body.get("code")
        self.retry_after = retry_after  # the server's Retry-After, in seconds
        super().__init__(f"HTTP {status_code}: {body.get('detail', body)}")


def parse_sse(lines: Iterator[str]) -> Iterator[EventPublic]:
    """EventPublic from `data:` lines of a text/event-stream (comments, `retry:` and `id:` lines skipped)."""
    data: list[str] = []
    for line in lines:
        if line.startswith("data:"):
            data.append(line[5:].lstrip())
        elif not line and data:
            yield EventPublic.model_validate_json("\n".join(data))
            data = []


# What `--working-dir` leaves out of the archive (gitignore-style names, matched against each path part).
DEFAULT_EXCLUDES = (".git", "__pycache__", "*.pyc", ".venv", "venv", ".mypy_cache", ".pytest_cache", ".ruff_cache",
                    ".ipynb_checkpoints", ".DS_Store", "node_modules")  # fmt: skip
ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)  # fixed member times: the same files make the same archive (and the same URI)


IGNORE_FILES = (".gitignore", ".rayignore")  # read in every folder, as `ray job submit --working-dir` reads them


def _ignore_spec(folder: Path) -> pathspec.PathSpec | None:
    """The .gitignore and .rayignore patterns of one folder (None: it has neither); gitignore's own rules, relative
    to that folder. `RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1` leaves .gitignore out, as it does for Ray."""
    names = [n for n in IGNORE_FILES if not (n == ".gitignore" and os.environ.get("RAY_RUNTIME_ENV_IGNORE_GITIGNORE"))]
    lines = [
        line for n in names if (folder / n).is_file() for line in (folder / n).read_text(errors="replace").splitlines()
    ]
    return pathspec.PathSpec.from_lines("gitwildmatch", lines) if lines else None


def zip_directory(directory: str | Path, out: IO[bytes], *, excludes: Sequence[str] = DEFAULT_EXCLUDES) -> int:
    """Write `directory`'s files into `out` as a zip under one top-level folder (Ray unpacks a remote working_dir
    without it, so the files land in the job's working directory). Left out: `excludes`, and what the .gitignore and
    .rayignore files of each folder say (as `ray job submit --working-dir` leaves it out). Returns the number of files
    written."""
    root = Path(directory).resolve()
    if not root.is_dir():
        raise NotADirectoryError(f"{directory} is not a directory")

    patterns = [p.strip("/") for p in excludes if p.strip("/")]  # "data/" and "/data" as gitignore means them
    ignores: list[tuple[Path, pathspec.PathSpec]] = []  # (folder, its patterns), for the folders walked so far

    def excluded(path: Path, is_dir: bool) -> bool:
        rel = path.relative_to(root).as_posix()
        parts = rel.split("/")
        if any(fnmatch.fnmatch(rel, p) or any(fnmatch.fnmatch(part, p) for part in parts) for p in patterns):
            return True
        for folder, spec in ignores:
            if folder == path.parent or folder in path.parents:
                inner = path.relative_to(folder).as_posix()
                if spec.match_file(inner + "/" if is_dir else inner):
                    return True
        return False

    count = 0
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for current, dirs, files in os.walk(root):  # symlinked folders are not followed
            here = Path(current)
            if (spec := _ignore_spec(here)) is not None:
                ignores.append((here, spec))
            dirs[:] = sorted(d for d in dirs if not excluded(here / d, True))
            for name in sorted(files):
                path = here / name
                if excluded(path, False) or not path.is_file():
                    continue
                rel = path.relative_to(root).as_posix()
                info = zipfile.ZipInfo(f"{root.name or 'code'}/{rel}", date_time=ZIP_EPOCH)
                info.external_attr = ((path.stat().st_mode & 0o777) | 0o100000) << 16
                info.compress_type = zipfile.ZIP_DEFLATED
                archive.writestr(info, path.read_bytes())
                count += 1
    return count


TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")  # the states a job ends in


def zipped(directory: str | Path, *, excludes: Sequence[str] = DEFAULT_EXCLUDES) -> tuple[bytes, int]:
    """`directory` as `--working-dir` uploads it (`zip_directory`), and how many files the archive holds."""
    with tempfile.TemporaryFile() as handle:
        files = zip_directory(directory, handle, excludes=excludes)
        handle.seek(0)
        return handle.read(), files


def working_dir_excludes(spec: dict[str, Any]) -> list[str]:
    """What an upload of the spec's working dir leaves out: the defaults and its `runtime_env.excludes`."""
    return [*DEFAULT_EXCLUDES, *((spec.get("runtime_env") or {}).get("excludes") or [])]


def with_working_dir(spec: dict[str, Any], uri: str) -> dict[str, Any]:
    """The spec running in the uploaded archive `uri` (its `runtime_env.working_dir`)."""
    return {**spec, "runtime_env": {**(spec.get("runtime_env") or {}), "working_dir": uri}}


class Client:
    """The REST API, typed (`api.schemas`). A GET, and a submit (which always carries an `Idempotency-Key`), is tried
    again after a transient failure (`api.retries`: no connection, a timeout, 429/502/503/504), `retries` more
    times at most; anything else is tried once. `AsyncClient` (`api.async_client`) is the same for asyncio."""

    def __init__(self, base_url: str = "http://127.0.0.1:8080", *, token: str | None = None, timeout: float = 30.0,
                 retries: int = retries_.RETRIES):  # fmt: skip
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)
        self.retries = retries

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _request(self, method: str, path: str, *, repeat: bool | None = None, **kwargs: Any) -> httpx.Response:
        """One request; tried again after a transient failure when it is safe to repeat (`repeat`, or by default a
        GET or a request with an Idempotency-Key)."""
        if not (repeat if repeat is not None else retries_.repeatable(method, kwargs.get("headers"))):
            return _checked(self.http.request(method, path, **kwargs))
        for attempt in Retrying(**retries_.policy(self.retries)):
            with attempt:
                return _checked(self.http.request(method, path, **kwargs))
        raise AssertionError("unreachable: tenacity re-raises the last failure")

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        r = self._request(method, path, **kwargs)
        return r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text

    def submit(self, spec: dict[str, Any], *, idempotency_key: str | None = None) -> JobPublic:
        """Queue a job. Its `Idempotency-Key` (a new one unless given) makes a retry after a lost answer return the
        same job, not a second one."""
        headers = {"Idempotency-Key": idempotency_key or uuid.uuid4().hex}
        return JobPublic.model_validate(self._call("POST", "/v1/jobs", json=spec, headers=headers))

    def validate(self, spec: dict[str, Any]) -> Validated:
        """`POST /v1/jobs/validate`: every check a submission runs, nothing queued (ApiError with the same 4xx)."""
        return Validated.model_validate(self._call("POST", "/v1/jobs/validate", json=spec))

    def upload_code(self, archive: bytes | IO[bytes]) -> dict[str, Any]:
        """`POST /v1/code`: store a zip archive; returns {"uri", "sha256", "size"}. Stored by its content, so sending
        it again after a transient failure stores nothing new: it is tried again, as a GET is."""
        data = archive if isinstance(archive, bytes) else archive.read()
        answer = self._call("POST", "/v1/code", content=data, headers={"Content-Type": "application/zip"}, repeat=True)
        return dict(answer)

    def upload_directory(self, directory: str | Path, *, excludes: Sequence[str] = DEFAULT_EXCLUDES) -> dict[str, Any]:
        """Zip `directory` (minus `excludes`) and upload it; the answer's `uri` is a `runtime_env.working_dir`."""
        return self.upload_code(zipped(directory, excludes=excludes)[0])

    def submit_with_working_dir(
        self, spec: dict[str, Any], directory: str | Path, *, idempotency_key: str | None = None
    ) -> JobPublic:
        """`shunter submit --working-dir DIR`: upload DIR, submit the spec with its URI as runtime_env.working_dir."""
        uri = self.upload_directory(directory, excludes=working_dir_excludes(spec))["uri"]
        return self.submit(with_working_dir(spec, uri), idempotency_key=idempotency_key)

    def put_secret(self, name: str, value: str, *, scope: str = "owner", **holder: str) -> SecretInfo:
        """Keep a secret a spec's `secrets:` may name (`holder`: `team=` or `owner=`, for an admin). A PUT replaces:
        safe to repeat."""
        params = {"scope": scope, **holder}
        r = self._request("PUT", f"/v1/secrets/{name}", params=params, json={"value": value}, repeat=True)
        return SecretInfo.model_validate(r.json())

    def secrets(self) -> list[SecretInfo]:
        """The secrets the caller's jobs may name: names, scopes and holders, never values."""
        return [SecretInfo.model_validate(s) for s in self._call("GET", "/v1/secrets")]

    def delete_secret(self, name: str, *, scope: str = "owner", **holder: str) -> None:
        self._request("DELETE", f"/v1/secrets/{name}", params={"scope": scope, **holder})

    def get(self, job_id: str) -> JobPublic:
        return JobPublic.model_validate(self._call("GET", f"/v1/jobs/{job_id}"))

    def list(self, *, state: str | None = None, limit: int = 50, cursor: str | None = None, **filters: str) -> JobList:
        params = {k: v for k, v in {"state": state, "limit": limit, "cursor": cursor, **filters}.items() if v}
        return JobList.model_validate(self._call("GET", "/v1/jobs", params=params))

    def cancel(self, job_id: str) -> dict[str, Any]:
        return dict(self._call("POST", f"/v1/jobs/{job_id}/cancel"))

    def retry(self, job_id: str) -> dict[str, Any]:
        return dict(self._call("POST", f"/v1/jobs/{job_id}/retry"))

    def _pages(self, path: str, params: dict[str, Any]) -> Iterator[Any]:
        """Every row of a paged list (a job's events, checkpoints, metrics), following X-Next-After page by page."""
        params = dict(params)
        while True:
            r = self._request("GET", path, params=params)
            yield from r.json()
            after = r.headers.get("X-Next-After")
            if not after:
                return
            params["after"] = after

    def events(self, job_id: str, *, after: int = 0) -> builtins.list[EventPublic]:
        """The job's events after `after`, oldest first: every page of them."""
        return [EventPublic.model_validate(e) for e in self._pages(f"/v1/jobs/{job_id}/events", {"after": after})]

    def all_events(self, *, after: int = 0, limit: int = 100) -> builtins.list[EventPublic]:
        """Events of every job the caller may see, oldest first."""
        rows = self._call("GET", "/v1/events", params={"after": after, "limit": limit})
        return [EventPublic.model_validate(e) for e in rows]

    def stream_events(
        self, job_id: str | None = None, *, after: int = 0, timeout_seconds: float | None = None
    ) -> Iterator[EventPublic]:
        """Server-Sent Events as they happen: one job's (ends after its terminal event) or every visible job's.
        Reconnects with `Last-Event-ID` if the connection drops, so no event is lost or repeated."""
        path = f"/v1/jobs/{job_id}/events" if job_id else "/v1/events"
        last = after
        while True:
            params: dict[str, Any] = {
                "follow": "true",
                **({"timeout_seconds": timeout_seconds} if timeout_seconds else {}),
            }
            try:
                with self.http.stream("GET", path, params=params, headers={"Last-Event-ID": str(last)},
                                      timeout=httpx.Timeout(30.0, read=60.0)) as r:  # fmt: skip
                    if r.status_code >= 400:
                        r.read()
                        raise ApiError(r.status_code, r.json())
                    for event in parse_sse(r.iter_lines()):
                        last = event.id
                        yield event
                return  # the server ended the stream: the job ended, or timeout_seconds passed
            except (httpx.ReadTimeout, httpx.RemoteProtocolError, httpx.ConnectError):
                time.sleep(1.0)  # dropped: resume after the last event seen

    def cluster(self) -> ClusterPublic:
        return ClusterPublic.model_validate(self._call("GET", "/v1/cluster"))

    def usage(self, **filters: str | datetime | None) -> UsagePublic:
        """`GET /v1/usage`; filters: owner, team, queue, since, until (datetimes or ISO-8601 strings)."""
        params = {k: v.isoformat() if isinstance(v, datetime) else v for k, v in filters.items() if v is not None}
        return UsagePublic.model_validate(self._call("GET", "/v1/usage", params=params))

    def prometheus(self) -> str:
        """The raw Prometheus text of `GET /metrics`."""
        return str(self._call("GET", "/metrics"))

    def attempts(self, job_id: str) -> builtins.list[AttemptPublic]:
        return [AttemptPublic.model_validate(a) for a in self._call("GET", f"/v1/jobs/{job_id}/attempts")]

    def checkpoints(self, job_id: str) -> builtins.list[CheckpointPublic]:
        """Every checkpoint of the job, in the order they were recorded (every page)."""
        return [CheckpointPublic.model_validate(c) for c in self._pages(f"/v1/jobs/{job_id}/checkpoints", {})]

    def metrics(self, job_id: str, *, name: str | None = None) -> builtins.list[MetricPoint]:
        """Every metric point of the job (only `name`'s, if given), in the order they were reported (every page)."""
        params = {"name": name} if name else {}
        return [MetricPoint.model_validate(m) for m in self._pages(f"/v1/jobs/{job_id}/metrics", params)]

    def logs(self, job_id: str, *, attempt: int | None = None, tail: int | None = None) -> str:
        """The attempt's log; with `tail`, only its last lines."""
        params = {k: v for k, v in {"attempt": attempt, "tail": tail}.items() if v}
        return str(self._call("GET", f"/v1/jobs/{job_id}/logs", params=params))

    def follow_logs(self, job_id: str, *, attempt: int | None = None, tail: int | None = None) -> Iterator[str]:
        params: dict[str, Any] = {
            "follow": "true",
            **{k: v for k, v in {"attempt": attempt, "tail": tail}.items() if v},
        }
        with self.http.stream("GET", f"/v1/jobs/{job_id}/logs", params=params, timeout=None) as r:
            if r.status_code >= 400:
                r.read()
                raise ApiError(r.status_code, r.json())
            yield from r.iter_text()

    def submit_sweep(self, request: dict[str, Any], *, idempotency_key: str | None = None) -> SweepPublic:
        """`POST /v1/sweeps`: a base spec and grid / points / count; every member is queued, or none."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return SweepPublic.model_validate(self._call("POST", "/v1/sweeps", json=request, headers=headers))

    def sweep(self, sweep_id: str) -> SweepPublic:
        return SweepPublic.model_validate(self._call("GET", f"/v1/sweeps/{sweep_id}"))

    def sweeps(self, *, limit: int = 50, cursor: str | None = None, owner: str | None = None) -> SweepList:
        params = {k: v for k, v in {"limit": limit, "cursor": cursor, "owner": owner}.items() if v}
        return SweepList.model_validate(self._call("GET", "/v1/sweeps", params=params))

    def cancel_sweep(self, sweep_id: str) -> SweepCancelled:
        return SweepCancelled.model_validate(self._call("POST", f"/v1/sweeps/{sweep_id}/cancel"))

    def health(self) -> dict[str, Any]:
        return dict(self._call("GET", "/healthz"))

    def ready(self) -> bool:
        return self.http.get("/readyz").status_code == 200

    def wait(self, job_id: str, *, timeout: float = 600.0, interval: float = 0.5) -> JobPublic:
        """Poll until the job ends (SUCCEEDED, FAILED or CANCELLED)."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.get(job_id)
            if job.state in TERMINAL:
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job.state} after {timeout:.0f}s")
            time.sleep(interval)


def _checked(r: httpx.Response) -> httpx.Response:
    """The answer, or its error raised as ApiError (the API's own body: detail, code, field)."""
    if r.status_code >= 400:
        try:
            body = r.json()
        except ValueError:
            body = {"detail": r.text}
        raise ApiError(r.status_code, body if isinstance(body, dict) else {"detail": body},
                       retry_after=_seconds(r.headers.get("Retry-After")))  # fmt: skip
    return r


def _seconds(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP date: the backoff's own wait applies
