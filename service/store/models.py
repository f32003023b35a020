"""SQL tables (SQLModel). The state column of `Job` is written only by `service.lifecycle.state.transition`."""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import JSON, BigInteger, Column, DateTime, Index, Text, text
from sqlalchemy.types import TypeDecorator
from sqlmodel import Field, SQLModel

from service.core import clock
from service.core.enums import ACTIVE_STATES, TERMINAL_STATES, EndReason, EventKind, JobState  # noqa: F401 (re-exported)


def utcnow() -> datetime:
    """The service's time (aware UTC): the wall clock, or a simulation's virtual one (`service.core.clock`)."""
    return clock.now()


def new_job_id() -> str:
    return "j" + uuid.uuid4().hex[:15]


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC on every backend (SQLite keeps no zone: store naive UTC, hand back aware)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        value = value.astimezone(timezone.utc)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value


def _tz() -> Any:
    return Column(UTCDateTime())


class Job(SQLModel, table=True):
    __tablename__ = "jobs"
    __table_args__ = (
        # The queue query: state='QUEUED' ORDER BY priority DESC, created_at — at any depth.
        # Admission order: priority DESC, then FIFO; the index matches the ORDER BY so no pass sorts the queue.
        Index("ix_jobs_admission_order", "state", text("priority DESC"), "created_at", "id"),
        Index("ix_jobs_state_queue_created", "state", "queue", "created_at", "id"),
        # Fair share reads each owner's first queued jobs (service.lifecycle.leases.queued_heads).
        Index("ix_jobs_owner_admission_order", "state", "owner", text("priority DESC"), "created_at", "id"),
        Index("ix_jobs_name_created", "name", "created_at", "id"),
        # Listings: ORDER BY created_at DESC, id DESC (the cursor's order), for everyone and per owner.
        Index("ix_jobs_created_id", "created_at", "id"),
        Index("ix_jobs_owner_created_id", "owner", "created_at", "id"),
        Index("ix_jobs_lease", "state", "lease_expires_at"),
        Index("ix_jobs_finished", "finished_at"),  # usage: jobs ended in a window
        Index("ix_jobs_sweep", "sweep_id", "sweep_index"),  # a sweep's members, in index order
        Index("ix_jobs_sweep_state", "sweep_id", "state"),  # max_parallel: the queued members of capped sweeps
        Index("ux_jobs_idempotency", "owner", "idempotency_key", unique=True),
        # An owner's bytes of specs not yet ended (service.store.spec_budget): a SUM read from the index alone.
        Index("ix_jobs_owner_state_spec_bytes", "owner", "state", "spec_bytes"),
    )

    id: str = Field(default_factory=new_job_id, primary_key=True, max_length=32)
    name: str = Field(max_length=128)
    owner: str = Field(default="anonymous", max_length=128, index=True)
    team: str | None = Field(default=None, max_length=128)  # the submitting token's team (fair share, quotas, usage)
    queue: str = Field(default="default", max_length=64, index=True)
    accelerator_type: str | None = Field(default=None, max_length=64)  # what its workers ask for (usage by type)
    priority: int = 0
    state: JobState = Field(default=JobState.QUEUED, max_length=16)
    state_reason: str | None = Field(default=None, sa_column=Column(Text))
    spec: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))
    # The spec's size as stored (compact JSON, `service.store.spec_cache.stored_size`), counted against the owner's
    # `max_queued_spec_bytes_per_owner` while the job has not ended.
    spec_bytes: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    attempt: int = 0
    idempotency_key: str | None = Field(default=None, max_length=255)
    spec_hash: str | None = Field(default=None, max_length=64)

    created_at: datetime = Field(default_factory=utcnow, sa_column=_tz())
    updated_at: datetime = Field(default_factory=utcnow, sa_column=_tz())
    started_at: datetime | None = Field(default=None, sa_column=_tz())
    finished_at: datetime | None = Field(default=None, sa_column=_tz())
    not_before: datetime | None = Field(default=None, sa_column=_tz())  # retry backoff

    lease_owner: str | None = Field(default=None, max_length=255)
    lease_token: str | None = Field(default=None, max_length=64)
    lease_expires_at: datetime | None = Field(default=None, sa_column=_tz())

    end_reason: EndReason | None = Field(default=None, max_length=32)
    last_error: str | None = Field(default=None, sa_column=Column(Text))
    # Attempts ended by preemption (to make room for another job, or on a node's drain notice): requeued, not counted
    # against max_attempts.
    preemptions: int = 0
    cluster_restarts: int = 0  # attempts lost with a Ray head restart: not counted unless the settings say so
    world_size: int | None = None  # workers of the current attempt, as admitted (an elastic job: within [min, max])
    preempt_requested_at: datetime | None = Field(default=None, sa_column=_tz())
    stalled_at: datetime | None = Field(default=None, sa_column=_tz())  # the current attempt's stacks were asked for
    # Dependencies (depends_on) not met yet: admission skips a job while this is above 0
    # (service.workflows.dependencies).
    waiting_on: int = Field(default=0, sa_column_kwargs={"server_default": "0"})

    # Progress, written by the job's own Train callback (fenced by attempt), read by status without asking Ray.
    step: int | None = None
    latest_metrics: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    latest_checkpoint: str | None = Field(default=None, sa_column=Column(Text))
    progress_at: datetime | None = Field(default=None, sa_column=_tz())
    # Things the user should know that did not stop the job (e.g. a strategy that was asked for and never applied).
    warnings: list[str] | None = Field(default=None, sa_column=Column(JSON))
    # The sweep (service.lifecycle.sweeps) this job is a member of, and its index there; None for a job submitted alone.
    sweep_id: str | None = Field(default=None, max_length=32)
    sweep_index: int | None = None


class Attempt(SQLModel, table=True):
    __tablename__ = "attempts"
    __table_args__ = (
        Index("ux_attempts_job_number", "job_id", "number", unique=True),
        Index("ix_attempts_ended", "ended_at"),  # fair share and usage read attempts running or ended lately
    )

    id: int | None = Field(default=None, primary_key=True)
    job_id: str = Field(foreign_key="jobs.id", max_length=32)
    number: int
    submission_id: str = Field(max_length=128, unique=True)
    submitted: bool = False  # Ray accepted the submission (or we adopted an existing one)
    ray_status: str | None = Field(default=None, max_length=16)
    started_at: datetime = Field(default_factory=utcnow, sa_column=_tz())
    ended_at: datetime | None = Field(default=None, sa_column=_tz())
    end_reason: EndReason | None = Field(default=None, max_length=32)
    message: str | None = Field(default=None, sa_column=Column(Text))
    log_uri: str | None = Field(default=None, sa_column=Column(Text))
    # When the driver said its run ended (train function returned or raised): the attempt ends on that word, and its
    # log is kept once Ray's job has exited (service.dispatch.late_logs).
    driver_ended_at: datetime | None = Field(default=None, sa_column=_tz())
    # What the attempt's worker group held from started_at to ended_at (fair share and usage accounting).
    cpus: float = Field(default=0.0, sa_column_kwargs={"server_default": "0"})
    gpus: float = Field(default=0.0, sa_column_kwargs={"server_default": "0"})
    # The worker group's pre-flight check (workers.preflight): per-rank facts and timings, what failed or was slow.
    preflight: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    # Ray nodes this attempt's workers were kept off (service.policy.exclusion), as admission decided; the driver's
    # label selector keeps Ray's placement off them too.
    excluded_nodes: list[str] | None = Field(default=None, sa_column=Column(JSON))
    # Rows this attempt's own reports wrote (metric points, checkpoint records, their events): capped by
    # `Settings.attempt_max_rows` (service.lifecycle.reports).
    rows_written: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    # SHA-256 of the nonce the driver sent with the attempt's bootstrap credential, once used (issue 38): used by
    # another, or again with another nonce, it is refused (api/routes/internal.py, `bootstrap`).
    bootstrap_nonce: str | None = Field(default=None, max_length=64)


class JobEvent(SQLModel, table=True):
    """Append-only history. Every state change writes one, in the same transaction."""

    __tablename__ = "job_events"
    __table_args__ = (Index("ix_events_job", "job_id", "id"),)

    id: int | None = Field(default=None, primary_key=True)
    job_id: str = Field(foreign_key="jobs.id", max_length=32)
    kind: str = Field(default=EventKind.STATE.value, max_length=32)  # an EventKind
    from_state: JobState | None = Field(default=None, max_length=16)
    to_state: JobState | None = Field(default=None, max_length=16)
    reason: str = Field(max_length=64)
    message: str | None = Field(default=None, sa_column=Column(Text))
    attempt: int | None = None
    actor: str | None = Field(default=None, max_length=255)
    at: datetime = Field(default_factory=utcnow, sa_column=_tz())


class Checkpoint(SQLModel, table=True):
    __tablename__ = "checkpoints"
    __table_args__ = (Index("ix_checkpoints_job", "job_id", "id"),)

    id: int | None = Field(default=None, primary_key=True)
    job_id: str = Field(foreign_key="jobs.id", max_length=32)
    attempt: int
    step: int | None = None
    uri: str = Field(sa_column=Column(Text, nullable=False))
    metrics: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    complete: bool = True  # written in full and sealed (manifest checked); only complete ones are resumed from
    pruned: bool = False  # deleted by the keep-N rule
    # The sha256 of its manifest as the attempt that wrote it reported it: a resume proves the checkpoint by it
    # (workers.proof), not by the storage every job can write. None: reported before it was kept, or listed from a
    # restore whose report was lost.
    manifest_sha256: str | None = Field(default=None, max_length=64)
    created_at: datetime = Field(default_factory=utcnow, sa_column=_tz())


class Metric(SQLModel, table=True):
    __tablename__ = "metrics"
    __table_args__ = (Index("ix_metrics_job_name", "job_id", "name", "step"),)

    id: int | None = Field(default=None, primary_key=True)
    job_id: str = Field(foreign_key="jobs.id", max_length=32)
    attempt: int
    step: int | None = None
    name: str = Field(max_length=128)
    value: float
    at: datetime = Field(default_factory=utcnow, sa_column=_tz())


class NodeFault(SQLModel, table=True):
    """A node an attempt's end named as at fault (a failed pre-flight, a lost worker or a collective timeout there).
    `service.policy.exclusion` reads these to keep the node out of the job's retries and, when several jobs failed on
    it, out of everyone's admissions for a cool-down; an admin's clear sets `cleared_at` on all of a node's faults."""

    __tablename__ = "node_faults"
    __table_args__ = (Index("ix_node_faults_job", "job_id"), Index("ix_node_faults_at", "at"))

    id: int | None = Field(default=None, primary_key=True)
    node_id: str = Field(max_length=64)
    address: str | None = Field(default=None, max_length=255)
    job_id: str = Field(foreign_key="jobs.id", max_length=32)
    attempt: int
    reason: str = Field(max_length=32)  # the attempt's EndReason value
    message: str | None = Field(default=None, sa_column=Column(Text))
    at: datetime = Field(default_factory=utcnow, sa_column=_tz())
    cleared_at: datetime | None = Field(default=None, sa_column=_tz())
    cleared_by: str | None = Field(default=None, max_length=128)


def new_sweep_id() -> str:
    return "s" + uuid.uuid4().hex[:15]


class Sweep(SQLModel, table=True):
    """One `POST /v1/sweeps` (service.lifecycle.sweeps); its members are ordinary jobs with `sweep_id` set."""

    __tablename__ = "sweeps"
    __table_args__ = (
        Index("ix_sweeps_created_id", "created_at", "id"),  # listings: ORDER BY created_at DESC, id DESC
        Index("ix_sweeps_owner_created_id", "owner", "created_at", "id"),
        Index("ux_sweeps_idempotency", "owner", "idempotency_key", unique=True),
    )

    id: str = Field(default_factory=new_sweep_id, primary_key=True, max_length=32)
    name: str = Field(max_length=128)
    owner: str = Field(default="anonymous", max_length=128)
    team: str | None = Field(default=None, max_length=128)
    request: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))  # the SweepRequest, as sent
    values: list[dict[str, Any]] = Field(sa_column=Column(JSON, nullable=False))  # each member's values, by index
    max_parallel: int | None = None
    metric_name: str | None = Field(default=None, max_length=128)
    metric_mode: str | None = Field(default=None, max_length=8)  # min | max
    idempotency_key: str | None = Field(default=None, max_length=255)
    request_hash: str | None = Field(default=None, max_length=64)
    created_at: datetime = Field(default_factory=utcnow, sa_column=_tz())
    cancelled_at: datetime | None = Field(default=None, sa_column=_tz())


class ClusterSnapshot(SQLModel, table=True):
    """The dispatcher's latest view of Ray's resources, so the API answers without calling Ray."""

    __tablename__ = "cluster_snapshots"

    id: int = Field(default=1, primary_key=True)
    dashboard_url: str | None = Field(default=None, sa_column=Column(Text))
    nodes: list[dict[str, Any]] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    total: dict[str, float] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    available: dict[str, float] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    taken_at: datetime = Field(default_factory=utcnow, sa_column=_tz())
    # The room last asked of the cluster's autoscaler ({bundles, jobs, asked_at}; service.dispatch.scaling), or null.
    scale_request: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON, nullable=True))


class QueueConfig(SQLModel, table=True):
    """A named queue's limits set over the API (they override `SHUNTER_QUEUES`)."""

    __tablename__ = "queues"

    name: str = Field(primary_key=True, max_length=64)
    max_running: int | None = None
    max_cpus: float | None = None
    max_gpus: float | None = None
    preemption: bool = False
    # Per owner / per team within this queue: {"max_running", "max_cpus", "max_gpus", "max_gpu_hours", "window_hours"}
    owner_quota: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    team_quota: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    cohort: str | None = Field(default=None, max_length=64)  # queues of one cohort lend each other idle quota
    borrowing_limit: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))  # {"cpus", "gpus"} at most
    accelerator_types: list[str] | None = Field(default=None, sa_column=Column(JSON))  # its jobs ask one of these
    updated_at: datetime = Field(default_factory=utcnow, sa_column=_tz())


class ProgressKey(SQLModel, table=True):
    """A key that signs attempt tokens (`service.tenancy.attempt_tokens`), made when `SHUNTER_PROGRESS_SECRET` is unset.
    All stored keys are accepted; the newest whose `active_from` has passed signs new tokens."""

    __tablename__ = "progress_keys"

    kid: str = Field(primary_key=True, max_length=32)
    secret: str = Field(sa_column=Column(Text, nullable=False))
    created_at: datetime = Field(default_factory=utcnow, sa_column=Column(UTCDateTime(), nullable=False))
    active_from: datetime = Field(default_factory=utcnow, sa_column=Column(UTCDateTime(), nullable=False))


class JobDependency(SQLModel, table=True):
    """One `depends_on` entry of a job: `job_id` waits for `depends_on` to meet `condition`. Written at submission;
    `outcome` (met / missed) is set in the transaction that ends the dependency
    (`service.workflows.dependencies.settle`)."""

    __tablename__ = "job_dependencies"
    __table_args__ = (
        Index("ux_job_dependencies_edge", "job_id", "depends_on", unique=True),
        Index("ix_job_dependencies_on", "depends_on", "outcome"),  # the end hook: a job's unsettled dependents
    )

    id: int | None = Field(default=None, primary_key=True)
    job_id: str = Field(foreign_key="jobs.id", max_length=32)
    depends_on: str = Field(foreign_key="jobs.id", max_length=32)
    position: int = 0  # its index in the spec's depends_on
    condition: str = Field(max_length=16)  # a dependency_spec.Condition value
    alias: str | None = Field(default=None, max_length=64)  # its `as`
    outcome: str | None = Field(default=None, max_length=16)  # None: pending; "met" or "missed"
    settled_at: datetime | None = Field(default=None, sa_column=_tz())
    # The dependency's latest complete checkpoint when it met the condition (what `${deps.<as>.checkpoint}` gives).
    checkpoint: str | None = Field(default=None, sa_column=Column(Text))


class CodeArchive(SQLModel, table=True):
    """One code archive `POST /v1/code` stored: the file is `<storage>/code/<owner>/<sha256>.zip`
    (`service.tenancy.code_store`), this row is `service.tenancy.code_archives`'. Whose it is, its content digest, its
    size (counted against the owner's `max_code_bytes_per_owner`), and when it was last uploaded or named by a submitted
    job: an archive unused for `code_retention_days` and named by no job that has not ended is deleted, file and row.
    What else is recorded of an archive at upload (digests to check it by when it is used) belongs here too, one row per
    archive.

    Archives stored before this table existed have no row until they are first used (a submission naming one, or the
    same content uploaded again): the row is made then, from the file."""

    __tablename__ = "code_archive"
    __table_args__ = (
        Index("ux_code_archive_owner_sha256", "owner", "sha256", unique=True),  # also an owner's SUM(size)
        Index("ix_code_archive_sha256", "sha256"),  # an admin's spec may name anyone's archive by its URI
        Index("ix_code_archive_last_used", "last_used_at"),  # the expiry pass: the longest unused first
    )

    id: int | None = Field(default=None, primary_key=True)
    owner: str = Field(max_length=128)
    sha256: str = Field(max_length=64)
    size: int = Field(sa_column=Column(BigInteger, nullable=False))  # bytes of the zip as stored
    created_at: datetime = Field(default_factory=utcnow, sa_column=Column(UTCDateTime(), nullable=False))
    last_used_at: datetime = Field(default_factory=utcnow, sa_column=Column(UTCDateTime(), nullable=False))
    # What it unpacks to, listed at upload from the bytes received ({path: sha256}, `service.tenancy.code_manifest`),
    # and the digest of that listing each attempt running it is handed, to check its working directory by
    # (service.tenancy.code_proof).
    tree: dict[str, str] | None = Field(default=None, sa_column=Column(JSON))
    tree_sha256: str | None = Field(default=None, max_length=64)


class Secret(SQLModel, table=True):
    """A secret's value, encrypted (`service.tenancy.secret_store`): an owner's, a team's or the cluster's (`scope`;
    `holder` is the owner or team name, "" for the cluster). A job's spec names it; its value reaches only the ranks of
    that owner's jobs, in their environment."""

    __tablename__ = "secrets"
    __table_args__ = (Index("ux_secrets_name", "scope", "holder", "name", unique=True),)

    id: int | None = Field(default=None, primary_key=True)
    scope: str = Field(max_length=8)  # owner, team or cluster
    holder: str = Field(max_length=128)
    name: str = Field(max_length=128)
    ciphertext: str = Field(sa_column=Column(Text, nullable=False))
    updated_at: datetime = Field(default_factory=utcnow, sa_column=Column(UTCDateTime(), nullable=False))
    updated_by: str = Field(max_length=128)


class SecretKey(SQLModel, table=True):
    """The key secrets are encrypted with when `SHUNTER_SECRETS_KEY` is unset: made once, shared by every process."""

    __tablename__ = "secret_keys"

    kid: str = Field(primary_key=True, max_length=32)
    key: str = Field(sa_column=Column(Text, nullable=False))
    created_at: datetime = Field(default_factory=utcnow, sa_column=Column(UTCDateTime(), nullable=False))
