"""What to do next with one admitted job, given what the database and Ray say about it. Pure: no I/O, no clock.

The dispatcher gathers the facts (`JobFacts`, `AttemptFacts`, Ray's `RayJobInfo` or None), calls `decide`, and
executes the actions it returns in order; the table test in tests/service/test_reconcile.py covers state x Ray status
x cancel x timeout x preemption x lease x submission patience in milliseconds.

Possible outcomes, by state (the state changes themselves happen in `Finish` and `MarkRunning`):
- STARTING, not yet submitted: Submit; Finish(infra) once submission has failed for `submit_seconds`.
- STARTING/RUNNING, Ray running: Wait; MarkRunning once every rank started (step 0) or on the first report;
  Stop(timeout | preempted | user_error).
- RUNNING, reported, then quiet for its stall timeout (`service.policy.stall`): DumpStacks, then Stop(stalled) once the
  stacks had time to reach the log; a report meanwhile means it recovered.
- any, Ray running but the driver's node is dead: Finish(cluster_restarted | node_lost), or Finish(cancelled).
- any, Ray ended: Finish(reason), where the retry policy then decides between QUEUED and an end state.
- any, the driver said its run ended (its result final), Ray still running or forgot it: Finish(that reason) at once,
  the log kept later (`service.dispatch.late_logs`); before this, an attempt ended seconds after its training did.
- CANCELLING: Stop until Ray ends it, then Finish(cancelled) (or the job's true end, if it finished first).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from service.core.backend import RayJobInfo
from service.core.enums import EndReason, JobState
from service.policy import end_reasons
from service.policy.stall import (
    STACK_DUMP_SECONDS,
    STACK_SETTLE_SECONDS,
    StallFacts,
    dump_message,
    is_current,
    quiet_seconds,
    stop_message,
)


@dataclass(frozen=True)
class JobFacts:
    state: JobState
    leased_to_me: bool = True
    step: int | None = None  # last reported step of the current attempt
    timeout_seconds: float | None = None
    preempt_requested_at: datetime | None = None
    checkpointed_since_preempt: bool = False  # a complete checkpoint arrived after the preemption request
    spec_error: str | None = None  # the stored spec no longer validates (a row written by an older release, ...)
    script: bool = False  # script mode: what starts on each rank is the user's script process
    num_workers: int = 1
    stall: StallFacts | None = None  # watched for a hang: RUNNING, and a first real report came (service.policy.stall)


@dataclass(frozen=True)
class AttemptFacts:
    submitted: bool
    started_at: datetime  # admission time of this attempt
    recorded_end: EndReason | None = None  # the driver's (or an earlier Stop's) account of why it ended
    driver_ended: bool = False  # recorded_end is the driver's word, sent once its run's result was final


@dataclass(frozen=True)
class Patience:
    submit_seconds: float = 120.0  # how long Ray may refuse a submission ("no agent yet") before the attempt fails
    preemption_grace_seconds: float = 60.0  # how long a preempted job may take to checkpoint before it is stopped
    stack_settle_seconds: float = STACK_SETTLE_SECONDS  # a stalled job's stacks, from dump to log
    stack_dump_seconds: float = STACK_DUMP_SECONDS  # the most a stalled job waits for its stack dump


# ---- actions ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Wait:
    why: str


@dataclass(frozen=True)
class Submit:
    """Build the attempt's Ray Job and submit it (idempotent on the submission id)."""


@dataclass(frozen=True)
class MarkSubmitted:
    """Ray has the attempt's job: record it (adopted: found there rather than submitted by this call)."""

    adopted: bool = True


@dataclass(frozen=True)
class MarkRunning:
    message: str


@dataclass(frozen=True)
class DumpStacks:
    """The attempt stalled: ask every rank for its Python stack (into the attempt's log) and note when, fenced on the
    report it was quiet since (a report that lands meanwhile cancels it)."""

    message: str
    progress_at: datetime


@dataclass(frozen=True)
class Stop:
    """Ask Ray to stop the attempt; first record why on the attempt, when there is a reason of ours."""

    record: EndReason | None = None
    message: str = ""


@dataclass(frozen=True)
class Finish:
    """Close the attempt with `reason`; the retry policy then requeues the job or ends it."""

    reason: EndReason
    message: str
    ray_status: str | None = None
    keep_logs: bool = False  # Ray ran the attempt: copy its log out before Ray forgets it
    log_later: bool = False  # its Ray Job is still exiting: keep its log once it has (service.dispatch.late_logs)


Action = Wait | Submit | MarkSubmitted | MarkRunning | DumpStacks | Stop | Finish


# ---- decisions --------------------------------------------------------------------------------------------------
def classify(state: JobState, recorded: EndReason | None, ray: RayJobInfo) -> EndReason:
    """Why an attempt that Ray reports ended did end: the driver's own record first, then what Ray says.

    A cancel wins over every end but success: the user asked for it, and the job was stopped for it.
    """
    if ray.status == "SUCCEEDED":
        return EndReason.SUCCEEDED
    if state is JobState.CANCELLING:
        return EndReason.CANCELLED
    if recorded is not None:
        return recorded
    if ray.status == "STOPPED":
        return EndReason.INFRA  # stopped, but not by us: an operator, or Ray's own shutdown
    if ray.error_type and "RUNTIME_ENV" in ray.error_type.upper():
        return EndReason.USER_ERROR  # a runtime_env the user asked for (pip, working_dir) could not be built
    return EndReason.INFRA  # the driver died without saying why: its node or process was lost


# Ends a driver may claim that cost no attempt once the dispatcher has seen the node go (service.dispatch.nodes): they
# wait for Ray's end of the Ray Job, so that the dispatcher's view of the nodes is at least as new as the end. A drained
# script's driver speaks within a second of the notice, before any tick may have seen the node draining.
CLAIMS_TO_CONFIRM = end_reasons.TO_CONFIRM


def driver_end(state: JobState, recorded: EndReason) -> EndReason:
    """Why an attempt ended by its driver's word did end: a cancel wins over every end but success, as in
    `classify`."""
    if recorded is EndReason.SUCCEEDED or state is not JobState.CANCELLING:
        return recorded
    return EndReason.CANCELLED


def decide(
    job: JobFacts, attempt: AttemptFacts, ray: RayJobInfo | None, *, now: datetime, patience: Patience,
    dead_nodes: Mapping[str, bool] | None = None,
) -> list[Action]:  # fmt: skip
    """The actions that bring one admitted job in line with its Ray Job, in the order to run them.

    `dead_nodes` (Ray node id -> was it a head) are the nodes the cluster knows dead: a Ray Job whose driver ran on
    one can never end, though Ray may go on reporting it RUNNING (a head restarted with GCS fault tolerance keeps the
    job table, not the drivers that ran on the old head).
    """
    if not job.leased_to_me:
        return [Wait("held by another dispatcher")]
    if job.state not in (JobState.STARTING, JobState.RUNNING, JobState.CANCELLING):
        return [Wait(f"{job.state.value} needs no reconciling")]
    waited = (now - attempt.started_at).total_seconds()

    if ray is None:
        if attempt.driver_ended and attempt.recorded_end is not None:  # its last word came before Ray forgot it
            return [Finish(driver_end(job.state, attempt.recorded_end), "the driver's own account", log_later=True)]
        if job.state is JobState.CANCELLING:
            return [Finish(EndReason.CANCELLED, "cancelled before Ray started it")]
        if job.spec_error is not None:
            return [Finish(EndReason.USER_ERROR, job.spec_error)]
        if attempt.submitted:
            return [Finish(EndReason.CLUSTER_RESTARTED, "Ray no longer knows this job: its head restarted")]
        if waited >= patience.submit_seconds:
            return [Finish(EndReason.INFRA, f"Ray did not accept the submission within {patience.submit_seconds:g}s")]
        return [Submit()]

    actions: list[Action] = [] if attempt.submitted else [MarkSubmitted(adopted=True)]
    if ray.is_terminal:
        reason = classify(job.state, attempt.recorded_end, ray)
        return [*actions, Finish(reason, ray.message or ray.status, ray_status=ray.status, keep_logs=True)]
    if attempt.driver_ended and attempt.recorded_end is not None and attempt.recorded_end not in CLAIMS_TO_CONFIRM:
        # The run's result is final (the driver said so once its last report landed): end the attempt now, not when
        # Ray Train's teardown and the driver's exit let Ray call the Ray Job ended, seconds later.
        reason = driver_end(job.state, attempt.recorded_end)
        return [*actions, Finish(reason, "the driver's own account", log_later=True)]
    if dead_nodes and ray.driver_node_id is not None and ray.driver_node_id in dead_nodes:
        head = dead_nodes[ray.driver_node_id]
        lost = f"its driver's node {ray.driver_node_id[:12]} ({'the old head' if head else 'a worker'}) is dead"
        if job.state is JobState.CANCELLING:
            return [*actions, Finish(EndReason.CANCELLED, f"cancelled; {lost}", ray_status=ray.status)]
        reason = EndReason.CLUSTER_RESTARTED if head else EndReason.NODE_LOST
        return [*actions, Finish(reason, f"Ray says {ray.status}, but {lost}", ray_status=ray.status)]
    if job.state is JobState.CANCELLING:
        return [*actions, Stop()]
    if job.spec_error is not None:
        return [*actions, Stop(EndReason.USER_ERROR, job.spec_error)]
    if job.preempt_requested_at is not None:
        asked = (now - job.preempt_requested_at).total_seconds()
        if job.checkpointed_since_preempt or asked >= patience.preemption_grace_seconds:
            return [*actions, Stop(EndReason.PREEMPTED, "stopped as asked: to make room for another job, or to grow")]
    if job.timeout_seconds is not None and waited > job.timeout_seconds:
        return [*actions, Stop(EndReason.TIMEOUT, f"ran past timeout_seconds={job.timeout_seconds:g}")]
    if job.state is JobState.STARTING and job.step is not None:
        return [*actions, MarkRunning(running_message(job))]
    if job.state is JobState.RUNNING and job.stall is not None:
        stalled = stall_action(job, job.stall, now=now, patience=patience)
        if stalled is not None:
            return [*actions, stalled]
    return [*actions, Wait(f"Ray says {ray.status}")]


def stall_action(job: JobFacts, facts: StallFacts, *, now: datetime, patience: Patience) -> Action | None:
    """A quiet attempt's next step: its stacks asked for, then a wait for them to reach the log, then its stop.
    None while it reports (or reported again since its stacks were asked for: it recovered)."""
    if quiet_seconds(facts, now) < facts.stall_after:
        return None
    if facts.stalled_at is None or not is_current(facts):
        return DumpStacks(dump_message(facts, step=job.step, now=now), progress_at=facts.progress_at)
    asked = (now - facts.stalled_at).total_seconds()
    ended = facts.dump_ended_at
    done = ended is not None and (now - ended).total_seconds() >= patience.stack_settle_seconds
    if done or asked >= patience.stack_dump_seconds:
        return Stop(EndReason.STALLED, stop_message(facts, step=job.step, now=now, dump_done=done))
    return Wait("stalled: waiting for every rank's stack to reach the attempt's log")


def running_message(job: JobFacts) -> str:
    """The state reason of RUNNING: every rank started (the workers' own word, step 0), or a first report came."""
    if job.step == 0:
        what = "script process" if job.script else "train loop"
        return f"every rank's {what} started ({job.num_workers} worker{'s' if job.num_workers != 1 else ''})"
    return f"workers placed; first report at step {job.step}"
