"""What each end reason means, in one table: a new reason is one row here (and its enum member, and its tests).

Read by the retry policy (`service.policy.retry`: retried? free?), reconcile (`service.policy.reconcile`: a driver's
claim to confirm), the writes of an end (`service.dispatch.finishing`: the job's state, its counter column, the
events and message) and the driver's API (`api.routes.internal`: what a job's own driver may record).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType

from service.core.enums import EndReason, EventKind, JobState


class Free(str, Enum):
    """When an end costs the job no attempt (`service.policy.retry.decide` holds the conditions)."""

    PREEMPTED = "preempted"  # asked to yield: while the job has free retries left
    CONFIRMED_NODE = "confirmed_node"  # its node went, and the cluster shows it: every job
    ELASTIC_NODE = "elastic_node"  # its node went, and the cluster shows it: an elastic job, which shrinks
    HEAD_RESTART = "head_restart"  # the Ray head lost it: unless the service counts head restarts


@dataclass(frozen=True)
class Meaning:
    """One end reason's row.

    `retryable`: another attempt may run while `max_attempts` allows; `opt_in`: the spec's `retries` flag that makes
    it retryable (else it is not). `free`: when a retry of it costs no attempt. `counter`: the job column one retry of
    it adds one to. `claimable`: a job's own driver may record it (its attempt token); `confirm`: such a claim costs
    nothing only once the dispatcher has seen the node go. `driver_account`: the attempt's message is the driver's own
    (it knows the node or the stall), not Ray's "stopped". `retry_event`: an event written beside the retry (its kind
    and reason); `retry_says`: what the requeue says in place of the end's message. `state`: the job's state when it
    is not retried. `says`: what it means, for users (docs/reference.md)."""

    says: str
    retryable: bool = False
    opt_in: str | None = None
    free: Free | None = None
    counter: str | None = None
    claimable: bool = True
    confirm: bool = False
    driver_account: bool = False
    retry_event: tuple[EventKind, str] | None = None
    retry_says: str | None = None
    state: JobState = JobState.FAILED


R = EndReason
TABLE: MappingProxyType[EndReason, Meaning] = MappingProxyType({
    R.SUCCEEDED: Meaning("the training function returned (or the script exited 0)", state=JobState.SUCCEEDED),
    R.USER_ERROR: Meaning("the user's code raised or exited non-zero, or its runtime_env could not be built"),
    R.OUT_OF_MEMORY: Meaning("a worker ran out of memory", retryable=True),
    R.WORKER_LOST: Meaning("a worker process died", retryable=True),
    R.NODE_LOST: Meaning("a node of the attempt was lost", retryable=True, free=Free.ELASTIC_NODE, confirm=True,
                         driver_account=True),
    R.COLLECTIVE_TIMEOUT: Meaning("a collective (all-reduce, barrier) timed out", retryable=True),
    R.NO_RESOURCES: Meaning("the cluster could not place the worker group"),
    R.TIMEOUT: Meaning("ran past timeout_seconds", opt_in="retry_on_timeout", claimable=False),
    R.CANCELLED: Meaning("cancelled by its owner or an admin", state=JobState.CANCELLED),
    R.PREEMPTED: Meaning("stopped to make room for a higher-priority job, or to grow; requeued", retryable=True,
                         free=Free.PREEMPTED, claimable=False,
                         retry_says="yielded as asked (its preemption_requested or grow_requested event says why)"),
    R.NODE_DRAINING: Meaning("a node announced its end: the attempt checkpointed and stopped; requeued",
                             retryable=True, free=Free.CONFIRMED_NODE, confirm=True, driver_account=True,
                             retry_event=(EventKind.DRAIN, "node_draining")),
    R.CLUSTER_RESTARTED: Meaning("the Ray head restarted and lost the attempt", retryable=True,
                                 free=Free.HEAD_RESTART, counter="cluster_restarts", claimable=False),
    R.PREFLIGHT_FAILED: Meaning("a rank failed the check before training; retried off the node it names",
                                retryable=True),
    R.STALLED: Meaning("reported progress, then none for stall_timeout_seconds: every rank's stack was dumped",
                       retryable=True, driver_account=True),
    R.DEPENDENCY_FAILED: Meaning("a job of its depends_on can no longer meet its condition"),
    R.STORAGE_TAMPERED: Meaning("its code archive or checkpoint is not what the service recorded (never retried: it "
                                "would stay tampered)"),
    R.INFRA: Meaning("Ray or shunter itself failed: a submission refused, a driver vanished", retryable=True),
})  # fmt: skip
if set(TABLE) != set(EndReason):  # pragma: no cover - a new member without its row stops the import
    raise RuntimeError(f"end reasons without a row: {sorted(set(EndReason) - set(TABLE))}")

CLAIMABLE = frozenset(r for r, m in TABLE.items() if m.claimable)  # what a job's driver may record
TO_CONFIRM = frozenset(r for r, m in TABLE.items() if m.confirm)
DRIVER_ACCOUNT = frozenset(r for r, m in TABLE.items() if m.driver_account)
NODE_ENDS = frozenset(r for r, m in TABLE.items() if m.free in (Free.CONFIRMED_NODE, Free.ELASTIC_NODE))  # a node went


def of(reason: EndReason) -> Meaning:
    return TABLE[reason]


def retryable(reason: EndReason, *, opted_in: frozenset[str] = frozenset()) -> bool:
    """Whether an attempt that ended so may be followed by another (`opted_in`: the spec's `retries` flags set)."""
    meaning = TABLE[reason]
    return meaning.retryable or (meaning.opt_in is not None and meaning.opt_in in opted_in)
