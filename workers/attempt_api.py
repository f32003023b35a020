"""The job's side of /internal/v1/attempts: how a running attempt reports its progress and reads its spec.

`AttemptApi` holds only strings (it is pickled into the Ray Train controller with the progress callback); the HTTP
client is made once per process and address, and kept alive, so a report costs one loopback or LAN round trip.
Errors are raised to the caller: progress writers log and skip them, the spec reader retries.
"""

from __future__ import annotations

import functools
import logging
import math
import sys
import time
import types
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote


def _without_httpx_cli() -> None:
    """httpx imports its command-line tool (`httpx._main`: click, rich, pygments) whenever those are installed, as
    they are beside shunter's own CLI: 160 ms of imports in the driver, the Train controller and every train worker,
    each on the way to a job's first step. A job's processes never run that tool, so before httpx is first imported
    there, its `main` is one that says so."""
    if "httpx" in sys.modules or "httpx._main" in sys.modules:
        return
    stub = types.ModuleType("httpx._main")

    def main(*args: object, **kwargs: object) -> None:
        raise RuntimeError("httpx's command-line tool is not loaded in a shunter job process")

    stub.main = main  # type: ignore[attr-defined]  # a module made here, its attribute set here
    sys.modules["httpx._main"] = stub


_without_httpx_cli()
import httpx  # noqa: E402 - after the stub above

log = logging.getLogger(__name__)
TIMEOUT = httpx.Timeout(5.0, connect=2.0)  # short: a report waits for it in the Train controller
# How long an attempt's first call, for its spec, waits for an API that is restarting (a `kill -9` and restart takes
# several seconds on a loaded machine: a driver that gave up after the 7.5 s it used to wait failed its job).
SPEC_PATIENCE_SECONDS = 60.0
TRANSIENT_STATUS = frozenset({500, 502, 503, 504})  # the API restarting, or its database away: try again


@functools.lru_cache(maxsize=1)
def _sender() -> Any:
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(1, thread_name_prefix="shunter-api")


def in_background(api: AttemptApi, call: Any, what: str) -> Any:
    """`call(api)` on this process's one sender thread, in order with the others sent so, without waiting for it: for
    news the train loop need not wait on (the process exits only once they are sent). A failure is logged. Returns
    the future.

    The API's client is made here, on the caller's thread: the sender then imports nothing (a module imported from
    two threads at once can be left half made, as Ray's was in a dispatcher that warmed its client on a thread)."""
    _client(api.url.rstrip("/"), api.token)

    def send() -> Any:
        try:
            return call(api)
        except Exception:  # noqa: BLE001 - news only: logged, never raised into the training run
            log.exception("shunter: could not send %s of job %s", what, api.job_id)
            return None

    return _sender().submit(send)


def sent_in_background(timeout: float) -> None:
    """Wait (at most `timeout` s) until what `in_background` was given so far is sent: before the attempt's last word,
    so news of the run (its pre-flight result, that it started) is never fenced off by its end."""
    if _sender.cache_info().currsize:
        from concurrent.futures import TimeoutError as Late

        try:
            _sender().submit(lambda: None).result(timeout=timeout)
        except Late:
            log.warning("shunter: news of this attempt still unsent after %.0fs", timeout)


class AttemptApiError(RuntimeError):
    """The attempt's API refused a call (a 4xx, or a 5xx past the call's patience): what a train loop or the driver
    sees, with the answer's status code. Picklable, as every exception a train worker raises must be: Ray sends it to
    the controller, and httpx's own HTTPStatusError cannot be rebuilt from its pickle (its request and response are
    keyword-only), so a refused call in a worker was reported as "A worker health check failed" instead."""

    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message, status_code)
        self.status_code = status_code

    def __str__(self) -> str:
        return str(self.args[0])


def transient(exc: BaseException) -> bool:
    """Whether a failed call may succeed if made again (the API down or restarting), rather than a refusal."""
    if isinstance(exc, httpx.HTTPStatusError):
        return exc.response.status_code in TRANSIENT_STATUS
    if isinstance(exc, AttemptApiError):  # what `AttemptApi` raises for an answer: a 503 is still worth a retry
        return exc.status_code in TRANSIENT_STATUS
    return isinstance(exc, httpx.TransportError)


@functools.lru_cache(maxsize=8)
def _client(base_url: str, token: str) -> httpx.Client:
    # trust_env=False: no proxy or .netrc from the environment comes between a job and its own API.
    return httpx.Client(
        base_url=base_url, headers={"Authorization": f"Bearer {token}"}, timeout=TIMEOUT, trust_env=False
    )


def finite_numbers(metrics: dict[str, Any]) -> dict[str, float]:
    """The metrics the API stores: finite numbers (not bools) under a name of 1..128 characters."""
    out = {}
    for name, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < len(str(name)) <= 128:
            continue
        if math.isfinite(float(value)):
            out[str(name)] = value
    return out


@dataclass(frozen=True)
class AttemptApi:
    url: str  # the API's base URL (SHUNTER_PROGRESS_URL)
    token: str = field(repr=False)  # the attempt token (never printed with the rest)
    job_id: str
    attempt: int

    def _path(self, what: str) -> str:
        return f"/internal/v1/attempts/{self.job_id}/{self.attempt}/{what}"

    def _call(self, method: str, what: str, body: dict[str, Any] | None = None, *, patience: float = 0.0) -> Any:
        """One call; a transient failure is tried again (backoff 0.25 s doubling) for up to `patience` seconds."""
        deadline, delay = time.monotonic() + patience, 0.25
        while True:
            try:
                response = _client(self.url.rstrip("/"), self.token).request(method, self._path(what), json=body)
                response.raise_for_status()
                return response.json()
            except (httpx.HTTPStatusError, httpx.TransportError) as exc:
                if not transient(exc) or time.monotonic() + delay > deadline:
                    if isinstance(exc, httpx.HTTPStatusError):
                        answer = exc.response.text[:1000]
                        raise AttemptApiError(f"{method} {self._path(what)}: {exc.response.status_code} {answer}",
                                              exc.response.status_code) from exc  # fmt: skip
                    raise
            time.sleep(delay)
            delay = min(delay * 2, 5.0)

    def report(
        self,
        metrics: dict[str, Any],
        *,
        step: int,
        checkpoint_uri: str | None = None,
        checkpoint_complete: bool = True,
        keep: int | None = None,
        patience: float = 0.0,
        manifest_sha256: str | None = None,
    ) -> bool:
        """Store one report; False when the attempt is no longer current (fenced off)."""
        body = self.report_body(metrics, step=step, checkpoint_uri=checkpoint_uri,
                                checkpoint_complete=checkpoint_complete, keep=keep,
                                manifest_sha256=manifest_sha256)  # fmt: skip
        return self.send_report(body, patience=patience)

    @staticmethod
    def report_body(
        metrics: dict[str, Any], *, step: int, checkpoint_uri: str | None = None, checkpoint_complete: bool = True,
        keep: int | None = None, manifest_sha256: str | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """`manifest_sha256`: of the checkpoint's manifest as this attempt sealed it; the service keeps it, and a
        resume proves the checkpoint by it (workers.proof)."""
        body = {"metrics": finite_numbers(metrics), "step": step, "checkpoint_uri": checkpoint_uri,
                "checkpoint_complete": checkpoint_complete, "keep": keep}  # fmt: skip
        if manifest_sha256 is not None:
            body["manifest_sha256"] = manifest_sha256
        return body

    def send_report(self, body: dict[str, Any], *, patience: float = 0.0) -> bool:
        return bool(self._call("POST", "report", body, patience=patience)["recorded"])

    def restored(
        self, checkpoint_uri: str, *, step: int | None, complete: bool, written_by: int | None,
        patience: float = 0.0,
    ) -> bool:  # fmt: skip
        """Say which checkpoint this attempt resumed from; False when fenced off or already said."""
        body = {"checkpoint_uri": checkpoint_uri, "step": step, "complete": complete, "written_by_attempt": written_by}
        return bool(self._call("POST", "restored", body, patience=patience)["recorded"])

    def started(self, *, patience: float = 0.0) -> bool:
        """Every rank of this attempt has started (its train loop, or its script process)."""
        return bool(self._call("POST", "started", {}, patience=patience)["recorded"])

    def checkpoint(self, uri: str, *, step: int | None, complete: bool = True, patience: float = 0.0) -> bool:
        """A checkpoint only (a script's sealed output folder): the job's step and metrics are left as they are."""
        body = {"metrics": {} if step is None else {"step": step}, "step": step or 0, "checkpoint_uri": uri,
                "checkpoint_complete": complete, "progress": False}  # fmt: skip
        return self.send_report(body, patience=patience)

    def preflight(self, report: dict[str, Any], *, patience: float = 0.0) -> bool:
        """The worker group's pre-flight result (`workers.preflight`); the attempt keeps the first one sent."""
        return bool(self._call("POST", "preflight", {"report": report}, patience=patience)["recorded"])

    def warning(self, code: str, message: str) -> bool:
        return bool(self._call("POST", "warning", {"code": code, "message": message[:4000]})["recorded"])

    def end(self, reason: str, message: str, *, patience: float = 0.0) -> bool:
        body = {"reason": reason, "message": message[-8000:]}
        return bool(self._call("POST", "end", body, patience=patience)["recorded"])

    def secrets(self, *, patience: float = SPEC_PATIENCE_SECONDS) -> dict[str, str]:
        """The values of the secrets the job's spec names (this object holds the attempt token)."""
        return {str(k): str(v) for k, v in self._call("GET", "secrets", patience=patience)["secrets"].items()}

    def bootstrap(self, nonce: str, *, patience: float = SPEC_PATIENCE_SECONDS) -> str:
        """The attempt token, for this object's bootstrap credential (held as its `token`) and the driver's nonce."""
        return str(self._call("POST", "bootstrap", {"nonce": nonce}, patience=patience)["token"])

    def reported(self) -> bool:
        return bool(self._call("GET", "reported")["reported"])

    def code_listing(self, *, patience: float = 10.0) -> dict[str, str]:
        """What the job's code archive unpacks to, as the service recorded it at upload: {path: sha256}."""
        return dict(self._call("GET", "code", patience=patience)["files"])

    def checkpoint_record(self, uri: str, *, patience: float = SPEC_PATIENCE_SECONDS) -> str | None:
        """The sha256 of the manifest of the job's checkpoint `uri`, as the service recorded it when the attempt that
        wrote it reported it; None when it recorded none (workers.proof)."""
        found = self._call("GET", f"checkpoint?uri={quote(uri, safe='')}", patience=patience)
        return found.get("manifest_sha256")

    def spec(self, *, patience: float = SPEC_PATIENCE_SECONDS) -> dict[str, Any]:
        """The job's spec. Nothing of an attempt can start without it, so a passing failure (the API restarting: no
        connection, a 5xx) is tried again for up to `patience` seconds, as long as the attempt's last word waits."""
        return dict(self._call("GET", "spec", patience=patience))
