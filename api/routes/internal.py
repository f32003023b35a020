"""/internal/v1/attempts: what a running job sends back (progress, warnings, how it ended) and reads (its spec).

The caller is the job itself (its driver, Train controller and train workers), authenticated by the attempt token the
dispatcher gave it (`service.tenancy.attempt_tokens`), never by a user API token: it may touch only the rows of the job
and attempt its token names (403 for any other path), and `service.lifecycle.reports` lands a write only while the job
is still on that attempt and active. Bodies are small and bounded (413 beyond `MAX_BODY_BYTES`); metric values are
finite numbers.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Path, Query
from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator
from sqlmodel import Session

from api.deps import RuntimeDep, SettingsDep
from api.limits import AttemptRates, retry_after
from api.schemas import ATTEMPT_LIMIT_RESPONSES, ERROR_RESPONSES
from service.core.errors import Conflict, Forbidden, NotFound, ShunterError, Unauthorized
from service.core.numbers import INT32_MAX
from service.dispatch import submission
from service.lifecycle import preflight_results, reports
from service.policy import end_reasons
from service.store.models import ACTIVE_STATES, EndReason, Job, JobState
from service.tenancy import attempt_tokens, code_proof

MAX_BODY_BYTES = 64 * 1024  # enforced while the body is read, by api.limits.BodyLimit (see api/app.py)
MAX_METRICS = 256
MAX_STEP = INT32_MAX  # jobs.step and metrics.step are 32-bit integers on PostgreSQL
# What a driver may say about its own end: never preemption, a timeout or a head restart (the dispatcher's own
# decisions and findings: `reconcile` sees a head restart itself), which would change how the job is retried; a
# claimed head restart was a retry that did not count, as often as a job cared to claim it (issue 35). Success it
# may: its train function returned, which is all a Ray Job's SUCCEEDED says too (an exit code the same code chooses);
# the dispatcher ends the attempt on it without waiting for Ray's teardown, and stops a Ray Job that lingers past
# `linger_seconds` after its driver's last word. `node_draining` and `node_lost` it may claim: they cost nothing only
# when Ray bears them out (service.dispatch.nodes), and only up to the job's free retries (service.policy.retry).
# `storage_tampered` (workers.proof) it may: that end is never retried, so a claim of it costs the claiming job alone.


PREFIX = "/internal/v1/attempts"
router = APIRouter(prefix=PREFIX, tags=["internal"], responses=ERROR_RESPONSES)
RATES = AttemptRates()
_TOLD: set[tuple[str, int]] = set()  # attempts whose timeline was told of their rate, by this process


class AttemptRateLimited(ShunterError):
    status_code = 429
    code = reports.RATE_LIMIT_REASON

    def __init__(self, detail: str, *, wait: float) -> None:
        super().__init__(detail)
        self.headers = {"Retry-After": retry_after(wait)}


def _within_rate(rt: Any, settings: Any, job_id: str, attempt: int, rows: int) -> None:
    """Take the report's rows from the attempt's rate (AttemptRates); beyond it the report is refused with a 429 and
    Retry-After, and the job's timeline says so once (asked of the database once per attempt in this process, so a
    job that floods costs no more than a refusal)."""
    wait = RATES.take((job_id, attempt), rows, per_second=settings.attempt_rows_per_second,
                      burst=settings.attempt_rows_burst)  # fmt: skip
    if not wait:
        return
    message = (
        f"this attempt's reports write faster than {settings.attempt_rows_per_second:g} rows a second (metric "
        "points, checkpoints: attempt_rows_per_second); they are refused until it slows down"
    )
    if (job_id, attempt) not in _TOLD:
        if len(_TOLD) > 10_000:
            _TOLD.clear()
        _TOLD.add((job_id, attempt))
        reports.record_limited(rt.engine, job_id=job_id, attempt=attempt, reason=reports.RATE_LIMIT_REASON,
                                message=message)  # fmt: skip
    raise AttemptRateLimited(message, wait=wait)


JobId = Annotated[str, Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
AttemptNo = Annotated[int, Path(ge=1, le=1_000_000)]
Finite = Annotated[float, Field(strict=True, allow_inf_nan=False)]


def _token_attempt(
    rt: RuntimeDep, settings: SettingsDep, authorization: Annotated[str | None, Header()] = None
) -> tuple[str, int]:
    scheme, _, presented = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not presented:
        raise Unauthorized("missing 'Authorization: Bearer <attempt token>' header")
    try:
        return attempt_tokens.verify(presented.strip(), attempt_tokens.keys_for(rt.engine, settings).accepted)
    except attempt_tokens.InvalidToken as exc:
        raise Unauthorized("not a valid attempt token") from exc


def _scope(
    job_id: JobId, attempt: AttemptNo, token: Annotated[tuple[str, int], Depends(_token_attempt)]
) -> tuple[str, int]:
    """The (job, attempt) of the path, which must be the token's own."""
    if (job_id, attempt) != token:
        raise Forbidden("this attempt token is for another job or attempt")
    return token


Scope = Annotated[tuple[str, int], Depends(_scope)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ReportBody(_Body):
    metrics: dict[Annotated[str, Field(min_length=1, max_length=128)], Finite] = Field(default_factory=dict)
    step: int = Field(0, ge=0, le=MAX_STEP, description="the report's step (rank 0's `step`, else its index)")
    checkpoint_uri: str | None = Field(None, min_length=1, max_length=4096)
    checkpoint_complete: StrictBool = True
    keep: int | None = Field(None, ge=1, le=100_000)
    progress: StrictBool = Field(True, description="false: a checkpoint only; the job's step and metrics stay")
    manifest_sha256: str | None = Field(
        None, pattern=r"^[0-9a-f]{64}$", description="of the checkpoint's manifest as sealed: a resume proves it by it"
    )

    @field_validator("metrics")
    @classmethod
    def _bounded(cls, metrics: dict[str, float]) -> dict[str, float]:
        if len(metrics) > MAX_METRICS:
            raise ValueError(f"at most {MAX_METRICS} metrics per report")
        step = metrics.get("step")
        if step is not None and not (0 <= step <= MAX_STEP and math.floor(step) == step):
            raise ValueError(f"metrics.step: a whole number from 0 to {MAX_STEP}")
        return metrics


class RestoredBody(_Body):
    checkpoint_uri: str = Field(min_length=1, max_length=4096)
    step: int | None = Field(None, ge=0, le=MAX_STEP, description="the checkpoint's step, from its manifest")
    complete: StrictBool = True
    written_by_attempt: int | None = Field(None, ge=1, le=1_000_000, description="from its manifest, when known")


class EndBody(_Body):
    reason: EndReason
    message: str = Field("", max_length=8000)

    @field_validator("reason")
    @classmethod
    def _driver_reason(cls, reason: EndReason) -> EndReason:
        if reason not in end_reasons.CLAIMABLE:  # the service finds the others itself
            raise ValueError(f"a driver cannot record {reason.value}")
        return reason


class WarningBody(_Body):
    code: str = Field(min_length=1, max_length=64, pattern=r"^[a-z0-9_]+$")
    message: str = Field(min_length=1, max_length=4000)


class Recorded(BaseModel):
    recorded: bool


class Reported(BaseModel):
    reported: bool


@router.post("/{job_id}/{attempt}/report", response_model=Recorded, responses=ATTEMPT_LIMIT_RESPONSES)
def report(scope: Scope, body: ReportBody, rt: RuntimeDep, settings: SettingsDep) -> Recorded:
    """One `ray.train.report` of rank 0 (and its checkpoint); `recorded: false` once the attempt is not current. 429
    beyond the attempt's rate or total of rows (`attempt_rows_per_second`, `attempt_max_rows`)."""
    job_id, attempt = scope
    rows = reports.report_rows(dict(body.metrics), body.checkpoint_uri, progress=body.progress)
    _within_rate(rt, settings, job_id, attempt, rows)
    recorded = reports.record_report(
        rt.engine, job_id=job_id, attempt=attempt, metrics=dict(body.metrics), checkpoint_uri=body.checkpoint_uri,
        checkpoint_complete=body.checkpoint_complete, keep=body.keep, report_index=body.step, progress=body.progress,
        max_rows=settings.attempt_max_rows, manifest_sha256=body.manifest_sha256,
    )  # fmt: skip
    return Recorded(recorded=recorded)


class StartedBody(_Body):
    pass


@router.post("/{job_id}/{attempt}/started", response_model=Recorded)
def started(scope: Scope, body: StartedBody, rt: RuntimeDep) -> Recorded:
    """Every rank's train loop (script mode: script process) of this attempt has started; the dispatcher then marks
    the job RUNNING. `recorded: false` when not current, or when a report came first."""
    job_id, attempt = scope
    return Recorded(recorded=reports.record_started(rt.engine, job_id=job_id, attempt=attempt))


@router.post("/{job_id}/{attempt}/restored", response_model=Recorded)
def restored(scope: Scope, body: RestoredBody, rt: RuntimeDep) -> Recorded:
    """The checkpoint this attempt's train loop resumed from (Ray Train's latest of the run), before its first step;
    listed if its own report never arrived. `recorded: false` when not current, or already recorded."""
    job_id, attempt = scope
    recorded = reports.record_restore(
        rt.engine, job_id=job_id, attempt=attempt, checkpoint_uri=body.checkpoint_uri, step=body.step,
        complete=body.complete, written_by=body.written_by_attempt,
    )  # fmt: skip
    return Recorded(recorded=recorded)


@router.post("/{job_id}/{attempt}/end", response_model=Recorded)
def end(scope: Scope, body: EndBody, rt: RuntimeDep) -> Recorded:
    """The driver's account of why its attempt ended (once per attempt)."""
    job_id, attempt = scope
    recorded = reports.record_attempt_end(
        rt.engine, job_id=job_id, attempt=attempt, reason=body.reason, message=body.message
    )
    return Recorded(recorded=recorded)


class PreflightBody(_Body):
    report: preflight_results.PreflightReport


@router.post("/{job_id}/{attempt}/preflight", response_model=Recorded)
def preflight_result(scope: Scope, body: PreflightBody, rt: RuntimeDep) -> Recorded:
    """The worker group's pre-flight check (once per attempt: the first result sent is kept)."""
    job_id, attempt = scope
    with Session(rt.engine) as session:
        return Recorded(recorded=preflight_results.record(session, job_id=job_id, attempt=attempt, report=body.report))


@router.post("/{job_id}/{attempt}/warning", response_model=Recorded, responses=ATTEMPT_LIMIT_RESPONSES)
def warning(scope: Scope, body: WarningBody, rt: RuntimeDep, settings: SettingsDep) -> Recorded:
    """Something the user should know that did not stop the job (once per attempt and code; counted with the
    reports' rows)."""
    job_id, attempt = scope
    _within_rate(rt, settings, job_id, attempt, 1)
    recorded = reports.record_warning(rt.engine, job_id=job_id, attempt=attempt, code=body.code, message=body.message,
                                       max_rows=settings.attempt_max_rows)  # fmt: skip
    return Recorded(recorded=recorded)


@router.get("/{job_id}/{attempt}/reported", response_model=Reported)
def reported(scope: Scope, rt: RuntimeDep) -> Reported:
    """Whether any report of this attempt was recorded."""
    job_id, attempt = scope
    return Reported(reported=reports.attempt_reported(rt.engine, job_id=job_id, attempt=attempt))


class CheckpointRecord(BaseModel):
    uri: str
    known: bool = Field(description="the job has a checkpoint of this URI")
    manifest_sha256: str | None = Field(description="of its manifest, as the attempt that wrote it reported it")


@router.get("/{job_id}/{attempt}/checkpoint", response_model=CheckpointRecord)
def checkpoint_record(
    scope: Scope, rt: RuntimeDep, uri: Annotated[str, Query(min_length=1, max_length=4096)]
) -> CheckpointRecord:
    """What the service recorded of the job's checkpoint `uri`: a resume proves the checkpoint by it before loading
    it (workers.proof), never by what the storage every job can write says."""
    job_id, _ = scope
    known, sealed = reports.checkpoint_manifest(rt.engine, job_id=job_id, uri=uri)
    return CheckpointRecord(uri=uri, known=known, manifest_sha256=sealed)


class CodeListing(BaseModel):
    uri: str
    sha256: str = Field(description="of the archive")
    digest: str = Field(description="of `files` (service.tenancy.code_manifest.digest): SHUNTER_CODE_DIGEST")
    files: dict[str, str] = Field(description="every file the archive unpacks to: its sha256")


@router.get("/{job_id}/{attempt}/code", response_model=CodeListing)
def code_listing(scope: Scope, rt: RuntimeDep) -> CodeListing:
    """What the job's code archive (its `runtime_env.working_dir`) unpacks to, as recorded at upload: the driver and
    the train workers name what differs in their working directory by it (workers.proof). 404 when the job ships no
    recorded archive."""
    job_id, _ = scope
    with Session(rt.engine) as session:
        job = session.get(Job, job_id)
        found = code_proof.listing(session, rt.settings, job) if job is not None else None
    if found is None:
        raise NotFound(f"job {job_id} ships no code archive recorded by POST /v1/code")
    return CodeListing(**found)


@router.get("/{job_id}/{attempt}/spec")
def spec(scope: Scope, rt: RuntimeDep) -> dict[str, Any]:
    """The job's spec, while the job is on this attempt and active (409 after), and not being cancelled: Ray may
    start a driver whose Job it already marked STOPPED (a stop that lands while the runtime env is set up), and
    that driver, refused its spec here, exits instead of training unseen with the cluster's room."""
    job_id, attempt = scope
    with Session(rt.engine) as session:
        job = on_attempt(session, job_id, attempt)
        return submission.driver_spec(session, job, rt.settings)  # `${deps.<as>...}` in its config filled in


def on_attempt(session: Session, job_id: str, attempt: int) -> Job:
    """The job, while it is on `attempt`, active and not being cancelled (404, else 409)."""
    job = session.get(Job, job_id)
    if job is None:
        raise NotFound(f"job {job_id} not found")
    if job.attempt != attempt or job.state not in ACTIVE_STATES:
        raise Conflict(f"job {job_id} is no longer on attempt {attempt}")
    if job.state == JobState.CANCELLING:
        raise Conflict(f"job {job_id} is being cancelled: attempt {attempt} must not start")
    return job
