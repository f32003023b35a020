"""Response bodies of the v1 API (requests are `service.spec.job.JobSpec`)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Out(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class Position(BaseModel):
    queue: int = Field(description="1 = next to be admitted in its queue")
    overall: int = Field(description="1 = next to be admitted overall")


class DependencyPublic(BaseModel):
    """One `depends_on` entry of a job, and where it stands (service.workflows.dependencies)."""

    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)

    job: str
    on: str = Field(description="succeeded | ended")
    as_: str | None = Field(None, alias="as")
    status: str = Field(description="pending | met | missed")
    state: str | None = Field(None, description="the dependency's state now")
    settled_at: datetime | None = None
    checkpoint: str | None = Field(None, description="its latest complete checkpoint when it met the condition")


class JobPublic(_Out):
    id: str
    name: str
    owner: str
    team: str | None = None
    queue: str
    priority: int
    state: str
    state_reason: str | None = None
    attempt: int
    world_size: int | None = Field(
        None, description="workers of the current attempt, as admitted (an elastic job: within its min and max)"
    )
    step: int | None = None
    loss: float | None = None
    latest_metrics: dict[str, float] | None = None
    latest_checkpoint: str | None = None
    end_reason: str | None = None
    last_error: str | None = None
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    progress_at: datetime | None = None
    ray_submission_id: str | None = None
    ray_dashboard_url: str | None = None
    # Queued jobs (GET /v1/jobs/{id}); state_reason says why it waits.
    position: Position | None = Field(
        None, description="a queued job's place in the order admission would use now, in its queue and overall"
    )
    estimated_start: datetime | None = Field(
        None,
        description="when a forward replay of admission expects a queued job to start (service/estimate.py); null "
        "when not known: a job it waits behind has no timeout_seconds, or it is more than 500 deep in the order",
    )
    # What the user should know that did not stop the job, e.g. a strategy asked for that the train loop never applied.
    warnings: list[str] = []
    spec: dict[str, Any] | None = Field(
        None, description="the job's spec: in GET /v1/jobs/{id} and at submission; in a list only with include=spec"
    )
    sweep_id: str | None = Field(None, description="the sweep this job is a member of (GET /v1/sweeps/{id})")
    sweep_index: int | None = Field(None, description="its index in that sweep")
    waiting_on: int = Field(0, description="dependencies not met yet: the job is not admitted while this is above 0")
    dependencies: list[DependencyPublic] | None = Field(
        None, description="GET /v1/jobs/{id} and submission: its depends_on entries and their status"
    )

    @field_validator("warnings", mode="before")
    @classmethod
    def _no_warnings(cls, value: Any) -> Any:
        return [] if value is None else value


class JobList(BaseModel):
    items: list[JobPublic]
    next_cursor: str | None = None


class EventPublic(_Out):
    id: int
    job_id: str
    kind: str
    from_state: str | None = None
    to_state: str | None = None
    reason: str
    message: str | None = None
    attempt: int | None = None
    actor: str | None = None
    at: datetime


class AttemptPublic(_Out):
    number: int
    submission_id: str
    submitted: bool
    ray_status: str | None = None
    started_at: datetime
    ended_at: datetime | None = None
    end_reason: str | None = None
    message: str | None = None
    preflight: dict[str, Any] | None = Field(None, description="the worker group's pre-flight check, as it ran")


class CheckpointPublic(_Out):
    id: int
    attempt: int
    step: int | None = None
    uri: str
    metrics: dict[str, Any] | None = None
    complete: bool
    pruned: bool = False
    created_at: datetime


class MetricPoint(_Out):
    step: int | None = None
    name: str
    value: float
    attempt: int
    at: datetime


class Accepted(BaseModel):
    id: str
    state: str
    detail: str


class ErrorBody(BaseModel):
    detail: str
    code: str
    field: str | None = None
    errors: list[dict[str, Any]] | None = None


class NodePublic(BaseModel):
    node_id: str
    address: str | None = None
    alive: bool = True
    total: dict[str, float]
    available: dict[str, float]


class ClusterJob(BaseModel):
    """A shunter job admitted to Ray and not yet ended, with the resources its worker group holds."""

    id: str
    name: str
    owner: str
    queue: str
    state: str
    attempt: int
    resources: dict[str, float]
    started_at: datetime | None = None
    ray_submission_id: str | None = None
    ray_dashboard_url: str | None = None


class ClusterPublic(BaseModel):
    """The Ray cluster as a dispatcher last saw it (the API never asks Ray); `taken_at` is None before that."""

    dashboard_url: str | None = None
    taken_at: datetime | None = None
    age_seconds: float | None = None
    nodes: list[NodePublic]
    total: dict[str, float]
    available: dict[str, float]
    # Which node holds which worker is not recorded yet: running jobs are listed for the whole cluster.
    jobs: list[ClusterJob]
    excluded_nodes: list[ExcludedNode] = Field(default_factory=list, description="kept out of every admission")
    scale_request: ScaleRequest | None = Field(None, description="room asked of the cluster's autoscaler, if any")


class ScaleRequest(BaseModel):
    """What a dispatcher last asked the cluster's autoscaler for (`SHUNTER_CLUSTER_MAY_GROW`): the bundles of the
    running groups and of the `jobs` waiting jobs it asks room for (Ray's autoscaler counts the cluster's total)."""

    bundles: list[dict[str, float]]
    jobs: int
    asked_at: datetime | None = None


class ExcludedNode(BaseModel):
    """A node on which several jobs failed: kept out of every admission until `until`, or an admin's clear."""

    node_id: str
    address: str | None = None
    why: str
    jobs: list[str]
    until: datetime


class ClearedNode(BaseModel):
    node_id: str
    cleared_faults: int


class ReadyBody(BaseModel):
    ready: bool
    checks: dict[str, bool]
    why: dict[str, str] = {}  # for each failed check, what is wrong ("not ready: Ray: ...")


_ERROR = {"model": ErrorBody}
_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before trying again", "schema": {"type": "string"}}}
# Documented on every /v1 route: what the one error handler can answer, all in the ErrorBody shape.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {**_ERROR, "description": "no or unknown bearer token (when tokens are configured)"},
    403: {**_ERROR, "description": "the caller may not do this (e.g. an admin-only change)"},
    404: {**_ERROR, "description": "no such job, or not the caller's"},
    409: {**_ERROR, "description": "conflicts with the job's state or an idempotency key"},
    413: {**_ERROR, "description": "the request body is over the service's limit (`SHUNTER_MAX_BODY_BYTES`)"},
    422: {**_ERROR, "description": "invalid request; `field` names the problem"},
    503: {
        **_ERROR,
        "description": "Ray or the database does not answer; try again",
        "headers": _RETRY_AFTER,
    },
}
# Documented on the attempt API's writes that are counted (its reports and warnings: issue 35).
ATTEMPT_LIMIT_RESPONSES: dict[int | str, dict[str, Any]] = {
    429: {
        **_ERROR,
        "description": "this attempt's reports write faster than `attempt_rows_per_second` (code "
                       "`attempt_rate_limited`; Retry-After says when to try again), or wrote `attempt_max_rows` rows "
                       "in all (code `attempt_row_cap`)",
        "headers": _RETRY_AFTER,
    },
}  # fmt: skip
# Documented on the endpoints that queue jobs (issue 35: an owner's bytes of specs not yet ended have a bound).
SPEC_BUDGET_RESPONSES: dict[int | str, dict[str, Any]] = {
    429: {
        **_ERROR,
        "description": "the caller's jobs that have not ended would hold more than "
                       "`max_queued_spec_bytes_per_owner` bytes of specs with these (code `spec_budget`, `field` "
                       "`spec`, or `base` for a sweep); accepted once some of them have ended",
    },
}  # fmt: skip
# Documented on the endpoints that can stream (`follow=true`).
STREAM_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    429: {
        **_ERROR,
        "description": "the caller already holds `max_streams_per_caller` follow streams in this API process",
        "headers": _RETRY_AFTER,
    },
}


class UsageTotals(_Out):
    cpu_hours: float
    gpu_hours: float
    attempts: int = Field(description="attempts that held resources in the window")
    gpu_hours_by_type: dict[str, float] = Field(
        default_factory=dict, description="the GPU-hours of jobs that asked for an accelerator type, by type"
    )


class UsageRow(UsageTotals):
    owner: str
    team: str | None = None
    queue: str


class QueueWaitPublic(_Out):
    """Seconds from submission to the first attempt's start: nearest-rank percentiles, None without jobs."""

    jobs: int
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None


class UsagePublic(_Out):
    """`GET /v1/usage`: resources held by attempts in `[since, until)` (running ones up to now), by owner, team and
    queue; the jobs that ended in the window; how long the jobs whose first attempt started in it waited."""

    since: datetime
    until: datetime
    rows: list[UsageRow]
    totals: UsageTotals
    jobs_ended: dict[str, int] = Field(description="jobs that finished in the window, by end state")
    end_reasons: dict[str, int] = Field(description="the same jobs, by end reason")
    queue_wait: QueueWaitPublic


class Validated(BaseModel):
    """A spec a submission would accept (`POST /v1/jobs/validate`): nothing was queued."""

    valid: bool = True
    state_reason: str | None = Field(None, description="why it would wait, when it would not start at once")
    warnings: list[str] = Field(default_factory=list)
    spec: dict[str, Any] = Field(description="the spec as the service reads it")


class SecretInfo(BaseModel):
    """A kept secret, by name (`/v1/secrets`): never its value."""

    name: str
    scope: Literal["owner", "team", "cluster"]
    owner: str | None = Field(None, description="whose it is (scope owner)")
    team: str | None = Field(None, description="whose it is (scope team)")
    updated_at: datetime
    updated_by: str
