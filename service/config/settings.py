"""All configuration, read once from `SHUNTER_*` environment variables (or a `.env` file)."""

from __future__ import annotations

import functools
import json
import os
import socket
from pathlib import Path
from typing import Any

from pydantic import Field, StrictFloat, StrictInt, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, YamlConfigSettingsSource

from service.config.tokens import TokenInfo
from service.core.numbers import StrictModel
from service.spec.job import MAX_SPEC_DEPTH, QUEUE_NAME
from service.spec.notify import ClusterWebhook


class NodeTypeConfig(StrictModel):
    """One node type of `SHUNTER_NODE_TYPES`: what each node holds (Ray's resources) and at most how many."""

    resources: dict[str, StrictFloat | StrictInt] = Field(min_length=1)
    max: int = Field(ge=0, le=100_000)


class ConfigFile(YamlConfigSettingsSource):
    """`SHUNTER_CONFIG`: a YAML file of settings by their names (`queues:`, `quotas:`, `fair_share:`, `webhooks:`,
    `database_url:` ...), below the environment. A key that names no setting is an error naming it: a typo in a
    reviewed file must not pass as the default."""

    def __call__(self) -> dict[str, Any]:
        data = super().__call__()
        unknown = sorted(set(data) - set(self.settings_cls.model_fields))
        if unknown:
            raise ValueError(f"{self.yaml_file_path}: unknown settings {unknown} (SHUNTER_<NAME>'s names, lowercase)")
        return data


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SHUNTER_", env_file=".env", extra="ignore")

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:  # fmt: skip
        """Arguments, then the environment (and .env), then `SHUNTER_CONFIG`'s file."""
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings, dotenv_settings, file_secret_settings]
        path = os.environ.get("SHUNTER_CONFIG")
        if path:
            if not Path(path).is_file():
                raise ValueError(f"SHUNTER_CONFIG: {path} is not a file")
            sources.append(ConfigFile(settings_cls, yaml_file=path))
        return tuple(sources)

    database_url: str = "sqlite:///./shunter.db"
    # Unset: `shunter serve` starts (or re-attaches to) a local Ray head of its own under data_dir.
    # Set: the GCS address of an existing cluster (`host:6379`); the Jobs API is then at ray_dashboard_url.
    ray_address: str | None = None
    ray_dashboard_url: str | None = None
    # "ray" (default), or "noop:<dir>": a stand-in that finishes every job at once, for queue stress tests and
    # benchmarks (see service/backends/noop.py).
    backend: str = "ray"
    storage_uri: str = "./shunter-data/checkpoints"
    data_dir: Path = Path("./shunter-data")

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=1, le=65535)
    # {"<token>": {"owner": "alice", "admin": false, "team": null, "queues": null, "max_priority": null}}: TokenInfo
    api_tokens: dict[str, TokenInfo] | None = None
    public_url: str | None = Field(None, description="how Ray workers reach this API; default http://host:port")

    # Merged into every job's runtime_env.env_vars (the spec's own values win), e.g. cluster-wide NCCL settings.
    job_env: dict[str, str] = Field(default_factory=dict)
    # Named queues and their limits, e.g. {"research": {"max_running": 2, "max_gpus": 8, "preemption": true}}.
    queues: dict[str, dict[str, Any]] = Field(default_factory=dict)
    # Per-owner and per-team quotas, cluster-wide: {"owner": {"*": {"max_running": 4, "max_gpus": 8}, "alice": {...}},
    # "team": {"ml": {"max_gpu_hours": 500, "window_hours": 168, "max_gpus_by_type": {"H100": 8}}}}
    # (see service/policy/quotas.py).
    quotas: dict[str, Any] = Field(default_factory=dict)
    # Fair share among waiting jobs of equal priority (see service/policy/fairshare.py): {"half_life_hours": 24,
    # "resource_weights": {"CPU": 1, "GPU": 10}, "team_weights": {...}, "owner_weights": {...}, "enabled": true}.
    fair_share: dict[str, Any] = Field(default_factory=dict)
    # A queued job blocked this long stops backfill behind it, so smaller jobs cannot starve it.
    reserve_after_seconds: float = Field(300.0, ge=0)
    # With an autoscaler, a job too big for today's cluster is held with a reason instead of refused, and the
    # dispatcher asks the autoscaler for the groups of the jobs that would start next (service/policy/demand.py).
    cluster_may_grow: bool = False
    # The node types the autoscaler can add (KubeRay worker groups, the launcher's available_node_types), e.g.
    # {"t4": {"resources": {"CPU": 4, "GPU": 1, "accelerator_type:T4": 1}, "max": 2}}: a job that none of them could
    # hold, even at their max counts, is refused at submission (422) instead of waiting.
    node_types: dict[str, NodeTypeConfig] = Field(default_factory=dict)
    # How many waiting jobs (in admission order) the autoscaler is asked room for at once.
    scale_max_pending_jobs: int = Field(8, ge=0, le=10_000)
    # Without node_types, a job whose room was asked for and has not come within this many seconds fails (user_error,
    # with its reason): nothing says whether any node could ever hold it. 0: it waits for ever.
    scale_up_timeout_seconds: float = Field(3600.0, ge=0)
    # A high-priority job whose room the autoscaler is asked for preempts no one for this long: the room may come.
    scale_up_grace_seconds: float = Field(120.0, ge=0)
    preemption_grace_seconds: float = Field(60.0, ge=0)
    # A running elastic job grows toward its max (a checkpoint-restart, see service/policy/growth.py) once its attempt
    # has run this long, when room is free and no job of equal or higher priority waits. The gain must be at least this
    # fraction of its workers (at least one worker).
    elastic_grow: bool = True
    elastic_grow_after_seconds: float = Field(600.0, ge=0)
    elastic_grow_min_gain: float = Field(0.25, ge=0)
    # An attempt lost with a Ray head restart is retried from its checkpoint; by default it does not use up the job's
    # retries.max_attempts (it was not the job's fault).
    count_cluster_restarts: bool = False
    # Drained attempts (and an elastic job's lost nodes) are retried without counting against max_attempts up to this
    # many times per job; past it they count, so a job that takes its own node down cannot be retried without end.
    max_free_node_losses: int = Field(20, ge=0)
    # Every attempt of a job that does not count (preempted, drained, shrunk, a head restart) is counted here; past
    # this many per job they count like any failure, so no job is retried for ever at no cost to it (issue 35).
    max_free_retries: int = Field(100, ge=0)
    # Node exclusion (service.policy.exclusion): a node named by a failed pre-flight check, or this many times by a lost
    # worker or a collective timeout, is kept out of that job's retries; one on which this many distinct jobs failed
    # within the cool-down is kept out of everyone's admissions until the cool-down has passed (or an admin clears it).
    node_exclusion_repeats: int = Field(2, ge=1)
    node_exclusion_jobs: int = Field(3, ge=1)
    node_exclusion_cooldown_seconds: float = Field(1800.0, ge=0)
    # ... and those jobs must have this many distinct owners (None: 2 when api_tokens are set, else 1), so that no one
    # user's jobs, whose end messages are their own code's to write, can keep a healthy node from everyone.
    node_exclusion_owners: int | None = Field(None, ge=1)
    # With Ray's GCS fault tolerance a restarted head keeps the cluster and its jobs, but not the processes that ran on
    # it. True: each attempt's Ray driver is placed off the head node, so running jobs outlive a head restart.
    ray_drivers_off_head: bool = False
    # Hang detection (service/policy/stall.py): an attempt that reported progress and then none for its stall timeout
    # has every rank's Python stack dumped into its log and ends `stalled` (retried like other failures). Without the
    # spec's stall_timeout_seconds the timeout is stall_factor x its longest recent interval between reports, never
    # under stall_min_seconds; stall_detection=false turns that default off (a spec's own timeout still applies).
    stall_detection: bool = True
    stall_min_seconds: float = Field(600.0, gt=0)
    stall_factor: float = Field(10.0, ge=1)

    dispatcher_id: str | None = Field(None, description="default: hostname:pid; `serve` uses a stable one")
    dispatcher_tick_seconds: float = Field(0.5, gt=0)
    lease_seconds: float = Field(15.0, gt=0)
    dispatcher_threads: int = Field(8, ge=1, le=64, description="jobs reconciled at once by one dispatcher")
    # `shunter dispatcher` (a dispatcher alone) serves its own /metrics (its tick histogram, its process) on this
    # address; 0: none. `serve` and `api` have theirs on the API's /metrics.
    dispatcher_metrics_host: str = "127.0.0.1"
    dispatcher_metrics_port: int = Field(9464, ge=0, le=65535)
    # How often a dispatcher removes the placement groups Ray should have removed and did not: not detached, of an
    # ended Ray job, made by a dead actor (service.backends.ray_jobs.orphaned). One left held keeps its CPUs and GPUs
    # from every later job for as long as the cluster lives.
    placement_group_sweep_seconds: float = Field(30.0, gt=0)
    # A Ray Job still running this long after its driver said the run ended is stopped (service.dispatch.late_logs).
    driver_linger_seconds: float = Field(60.0, gt=0)
    # Between ticks a dispatcher wakes on signals (service.store.signals: a job posted, an attempt ended, a cancel); two
    # such passes are at least this far apart, so a burst of posts costs one pass, not one each.
    dispatcher_wake_spacing_seconds: float = Field(0.1, ge=0)
    # Attempt-scoped progress credentials (issue 12): jobs report through the API with a token signed by this key,
    # never with the database URL. Unset: a key is made once and kept in the database, shared by every process.
    # During a rotation, tokens signed by the previous keys are still accepted.
    progress_secret: str | None = Field(None, repr=False)
    progress_previous_secrets: list[str] = Field(default_factory=list, repr=False)
    # Secrets jobs name (issue 38, service.tenancy.secret_store) are encrypted with this key (any long random string);
    # unset, a key is made once and kept in the database. Values encrypted with a previous key are still read.
    secrets_key: str | None = Field(None, repr=False)
    secrets_previous_keys: list[str] = Field(default_factory=list, repr=False)
    max_secrets_per_holder: int = Field(200, ge=1, description="secrets one owner, team or the cluster may keep")
    # Bounds per caller (issue 12).
    max_body_bytes: int = Field(1 << 20, ge=1024, description="largest request body; 413 beyond")
    max_spec_depth: int = Field(32, ge=4, le=MAX_SPEC_DEPTH, description="deepest nesting a job spec may have")
    max_streams_per_caller: int = Field(8, ge=1, description="concurrent follow streams per caller; 429 beyond")
    # The fair gate in front of every route but the probes (api.gate, issue 35): this many requests compute at once in
    # an API process; the others wait (no thread, no session), and each free place goes to the waiting caller with
    # the fewest computing. A caller may have `api_waiting_per_caller` waiting (429 beyond); none waits longer than
    # `api_max_wait_seconds` (503). Two: Python computes one request at a time per process, so a tenant's request
    # shares it with at most one other (bench/flood.py: p99 3.5x quiet at three, under 2x at two, with callers keyed
    # by owner); more processes, not more places, use more cores.
    api_concurrency: int = Field(2, ge=1, le=256, description="requests computing at once per API process")
    api_waiting_per_caller: int = Field(64, ge=1, description="requests one caller may have waiting; 429 beyond")
    api_max_wait_seconds: float = Field(30.0, gt=0, description="longest a request waits for a place; 503 beyond")
    # A running attempt's log is Ray's, read by byte range in blocks of this size (issue 35): what one request holds of
    # it at most is two blocks and a 64 KiB chunk, and what the API keeps per attempt between polls is one block,
    # whatever the log's size. The dispatcher copies an ended attempt's log out in 64 KiB chunks.
    ray_log_block_bytes: int = Field(1 << 20, ge=4096, le=64 << 20, description="bytes of a Ray log read at once")
    # What one attempt of a job may write through its reports (issue 35): metric points, checkpoint records and the
    # events they add. A rate (per API process: a token bucket of `attempt_rows_burst`, refilled at
    # `attempt_rows_per_second`) and a total; beyond either the report is refused with a 429 and the job's timeline
    # says so, once. The burst holds the largest report (256 metrics and a checkpoint).
    attempt_rows_per_second: float = Field(2000.0, gt=0)
    attempt_rows_burst: int = Field(20_000, ge=300)
    attempt_max_rows: int = Field(5_000_000, ge=300)
    stream_max_seconds: float = Field(3600.0, gt=0, description="a follow stream ends after this long")
    max_code_bytes: int = Field(100 << 20, ge=1024, description="largest code archive POST /v1/code takes")
    # What an archive may unpack to: a small deflate bomb or a zip of 200,000 empty entries cost seconds of the API's
    # CPU to check and a node's disk to unpack (issue 35). Checked on the archive's directory, before a member is read.
    max_code_unpacked_bytes: int = Field(1 << 30, ge=1024, description="largest total a code archive unpacks to")
    max_code_entries: int = Field(20_000, ge=1, description="most members a code archive may hold")
    # What an owner's code archives may take of the storage, all together (413 beyond; the same content uploaded again
    # costs nothing), and how long one nobody uses is kept: an archive not uploaded again nor named by a submission
    # for `code_retention_days`, and named by no job that has not ended, is deleted by a dispatcher's pass (every
    # `code_expiry_seconds`); a job submitted naming it afterwards is refused (422), as for an unknown archive.
    max_code_bytes_per_owner: int = Field(10 << 30, ge=1024, description="storage all of an owner's archives may take")
    code_retention_days: float = Field(30.0, gt=0, description="an archive unused this long may be deleted")
    code_expiry_seconds: float = Field(3600.0, gt=0, description="how often a dispatcher deletes expired archives")

    # How long Ray may refuse an attempt's submission (e.g. "no agent yet" just after a head starts) before the
    # attempt ends as infra; and how long one job's reconcile may keep failing unexpectedly before that job is ended.
    submit_patience_seconds: float = Field(120.0, gt=0)
    job_fault_patience_seconds: float = Field(60.0, gt=0)
    admit_batch: int = Field(64, ge=1, le=10_000, description="queued jobs one admission pass considers")
    max_sweep_members: int = Field(1000, ge=1, le=100_000, description="the most jobs one POST /v1/sweeps makes")
    max_sweep_bytes: int = Field(
        16 << 20, ge=1024, description="the most bytes of job specs one POST /v1/sweeps stores, its members together"
    )
    # The bytes of specs an owner's jobs that have not ended may hold together (queued ones, and those running): a
    # submission (a job, a sweep's members, a retry) that would take the owner over it is refused with a 429 until
    # some of them end. Each job is counted at its stored spec's size (`Job.spec_bytes`).
    max_queued_spec_bytes_per_owner: int = Field(
        256 << 20, ge=1024, description="the most bytes of specs one owner's jobs that have not ended hold together"
    )

    # The managed local Ray head (only when ray_address is unset).
    local_ray_num_cpus: int | None = None
    local_ray_num_gpus: int | None = None
    local_ray_dashboard_port: int = 8265
    stop_ray_on_exit: bool = True
    # How often the Ray Train controller polls workers: each ray.train.report() waits for that poll.
    train_poll_seconds: float = Field(0.25, gt=0)

    # Notifications (service/workflows/webhooks.py): cluster-wide targets, a JSON list of {"url", "events", "format",
    # "secret"} told of every job's changes; the secret that signs deliveries whose entry has none of its own; whether
    # loopback and private addresses may be called (tests, a private network's own receivers); and the retries.
    webhook_secret: str | None = Field(None, min_length=16, repr=False)  # before webhooks: its check reads it
    webhooks: list[ClusterWebhook] = Field(default_factory=list)
    webhook_allow_private: bool = False
    webhook_max_attempts: int = Field(15, ge=1, le=100)
    webhook_backoff_seconds: float = Field(2.0, gt=0)
    webhook_backoff_max_seconds: float = Field(600.0, gt=0)
    webhook_timeout_seconds: float = Field(5.0, gt=0, le=60)
    webhook_concurrency: int = Field(8, ge=1, le=64, description="deliveries in flight at once per process")
    webhook_poll_seconds: float = Field(
        0.5,
        gt=0,
        description="how often the outbox is read while it has work; "
        "after passes that found none, up to 4 times as long",
    )

    @field_validator("job_env", "queues", "api_tokens", "quotas", "fair_share", "node_types", mode="before")
    @classmethod
    def _json_mappings(cls, value: Any, info: ValidationInfo) -> Any:
        """These settings are JSON objects in the environment; an empty value means none."""
        if isinstance(value, str):
            empty: dict[str, Any] | None = None if info.field_name == "api_tokens" else {}
            return json.loads(value) if value.strip() else empty
        return value

    @field_validator("api_tokens")
    @classmethod
    def _token_keys(cls, value: dict[str, TokenInfo] | None) -> dict[str, TokenInfo] | None:
        for token in value or {}:
            if not token or token != token.strip() or " " in token:
                raise ValueError("a token must be non-empty and hold no spaces (it is sent as 'Bearer <token>')")
        return value

    @field_validator("queues")
    @classmethod
    def _queue_names(cls, value: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for name in value:
            if not QUEUE_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not a queue name (lowercase letters, digits, '_' or '-')")
        return value  # each queue's limits are checked with the other policies (service.config.policies.check)

    @field_validator("webhook_secret", mode="before")
    @classmethod
    def _unset_when_empty(cls, value: Any) -> Any:
        return None if isinstance(value, str) and not value.strip() else value  # SHUNTER_WEBHOOK_SECRET= is unset

    @field_validator("webhooks")
    @classmethod
    def _webhooks_signed(cls, value: list[ClusterWebhook], info: ValidationInfo) -> list[ClusterWebhook]:
        if any(t.secret is None for t in value) and not info.data.get("webhook_secret"):
            raise ValueError("a target without its own secret needs SHUNTER_WEBHOOK_SECRET to sign with")
        return value

    def resolved_dispatcher_id(self, *, stable: bool = False) -> str:
        if self.dispatcher_id:
            return self.dispatcher_id
        host = socket.gethostname()
        # A stable id lets a restarted single-process `serve` re-own its leases at once instead of waiting them out.
        return f"serve@{host}:{self.data_dir.resolve()}" if stable else f"{host}:{os.getpid()}"

    def absolute_storage_uri(self) -> str:
        if "://" in self.storage_uri:
            return self.storage_uri
        return str(Path(self.storage_uri).resolve())


@functools.lru_cache
def get_settings() -> Settings:
    """The process-wide settings; tests build their own `Settings(...)` and pass it in instead."""
    return Settings()
