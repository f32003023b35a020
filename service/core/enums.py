"""The states, end reasons and event kinds of jobs: plain enums, importable without the database layer (a job's
driver names its end with `EndReason` and imports nothing of SQLAlchemy's). `service.store.models` re-exports them."""

from __future__ import annotations

from enum import Enum


class JobState(str, Enum):
    QUEUED = "QUEUED"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    CANCELLING = "CANCELLING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
ACTIVE_STATES = frozenset({JobState.STARTING, JobState.RUNNING, JobState.CANCELLING})


class EndReason(str, Enum):
    """Why an attempt (or a job) ended. Distinct causes get distinct names; what each means (retried? free? who may
    claim it?) is its row of `service.policy.end_reasons`."""

    SUCCEEDED = "succeeded"
    USER_ERROR = "user_error"  # the user's code raised or exited non-zero
    OUT_OF_MEMORY = "out_of_memory"
    WORKER_LOST = "worker_lost"
    NODE_LOST = "node_lost"
    COLLECTIVE_TIMEOUT = "collective_timeout"
    NO_RESOURCES = "no_resources"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    PREEMPTED = "preempted"  # stopped to make room for a higher-priority job; requeued, not a failure
    NODE_DRAINING = "node_draining"  # a node announced its end: checkpointed and stopped; requeued, not a failure
    CLUSTER_RESTARTED = "cluster_restarted"  # the Ray head restarted and lost its Jobs: not the job's fault
    PREFLIGHT_FAILED = "preflight_failed"  # a rank failed the check before training (workers.preflight): names it
    STALLED = "stalled"  # reported progress, then none for stall_timeout_seconds: every rank's stack was dumped
    DEPENDENCY_FAILED = "dependency_failed"  # a job of its depends_on can no longer meet its condition (never retried)
    # Its code archive or the checkpoint it resumes from is not what the service recorded when their owner wrote them
    # (workers.proof): never retried, as a tampered archive or checkpoint stays tampered, and a retry would only run
    # into it again (or, for a checkpoint, resume from an earlier one the user did not choose).
    STORAGE_TAMPERED = "storage_tampered"
    INFRA = "infra"  # Ray or shunter itself failed: submission refused, driver vanished


class EventKind(str, Enum):
    """What a `JobEvent` records. `service.lifecycle.state.record_event` (and `transition`, for STATE) are its only
    writers."""

    STATE = "state"  # a state change (from -> to)
    RAY = "ray"  # submitted to Ray, or an existing Ray Job adopted
    LEASE = "lease"  # a dispatcher took over a job whose lease ran out
    RETRY = "retry"  # the retry policy decided to run another attempt
    PREEMPTION = "preemption"  # asked to yield to a higher-priority job
    CHECKPOINT = "checkpoint"  # a checkpoint was reported
    WARNING = "warning"  # something the user should know that did not end the job
    HOST = "host"  # a fault of shunter's own host while handling the job (skipped, retried next tick)
    DRAIN = "drain"  # a node of the attempt announced its end: the notice, the checkpoint, the steps lost
    RESIZED = "resized"  # an elastic job's attempt runs at another world size than the one before
    PREFLIGHT = "preflight"  # the worker group's check before training: its result, a slow rank's warning
    STALL = "stall"  # no progress for stall_timeout_seconds: every rank's stack dumped, then the attempt stopped
    NODE = "node"  # a node kept out of the job's next attempt (or of everyone's admissions), or let back in
    DEPENDENCY = "dependency"  # a job of its depends_on met its condition (service.workflows.dependencies)
    SCALE = "scale"  # room asked of the cluster's autoscaler for it, or arrived (service.dispatch.scaling)
