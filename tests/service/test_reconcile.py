"""The reconcile decision table: state x Ray status x cancel x timeout x preemption x lease x submission patience.

Pure: no database, no Ray, no clock. Explicit rows first, then a sweep over every combination checking the rules
that must hold whatever the row.
"""

from __future__ import annotations

import itertools
from datetime import datetime, timedelta, timezone

import pytest

from service.core.backend import RayJobInfo
from service.policy.reconcile import (
    AttemptFacts,
    DumpStacks,
    Finish,
    JobFacts,
    MarkRunning,
    MarkSubmitted,
    Patience,
    Stop,
    Submit,
    Wait,
    classify,
    decide,
)
from service.policy.stall import StallFacts
from service.store.models import EndReason, JobState

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)
PATIENCE = Patience(submit_seconds=120, preemption_grace_seconds=60)
S, R = JobState, EndReason


def ago(seconds: float) -> datetime:
    return NOW - timedelta(seconds=seconds)


def ray(status: str | None, **kw: object) -> RayJobInfo | None:
    return None if status is None else RayJobInfo("shunter-j1-1", status, **kw)  # type: ignore[arg-type]


def kinds(actions: list[object]) -> list[str]:
    return [type(a).__name__ for a in actions]


ROWS = [
    # (name, job facts, attempt facts, Ray status, expected actions)
    ("new attempt is submitted", JobFacts(S.STARTING), AttemptFacts(False, ago(1)), None, [Submit()]),
    ("submission refused past patience ends infra", JobFacts(S.STARTING), AttemptFacts(False, ago(121)), None,
     [Finish(R.INFRA, "Ray did not accept the submission within 120s")]),
    ("Ray lost a submitted job", JobFacts(S.RUNNING), AttemptFacts(True, ago(5)), None,
     [Finish(R.CLUSTER_RESTARTED, "Ray no longer knows this job: its head restarted")]),
    ("cancelled before Ray had it", JobFacts(S.CANCELLING), AttemptFacts(False, ago(1)), None,
     [Finish(R.CANCELLED, "cancelled before Ray started it")]),
    ("stored spec broken, never submitted", JobFacts(S.STARTING, spec_error="spec: bad"), AttemptFacts(False, ago(1)),
     None, [Finish(R.USER_ERROR, "spec: bad")]),
    ("stored spec broken while running: stop it as a user error", JobFacts(S.RUNNING, spec_error="spec: bad"),
     AttemptFacts(True, ago(1)), "RUNNING", [Stop(R.USER_ERROR, "spec: bad")]),
    ("found in Ray, not recorded: adopt, then wait", JobFacts(S.STARTING), AttemptFacts(False, ago(1)), "PENDING",
     [MarkSubmitted(adopted=True), Wait("Ray says PENDING")]),
    ("first report makes it RUNNING", JobFacts(S.STARTING, step=3), AttemptFacts(True, ago(9)), "RUNNING",
     [MarkRunning("workers placed; first report at step 3")]),
    ("every script process started makes it RUNNING", JobFacts(S.STARTING, step=0, script=True, num_workers=2),
     AttemptFacts(True, ago(9)), "RUNNING", [MarkRunning("every rank's script process started (2 workers)")]),
    ("every train loop started makes it RUNNING", JobFacts(S.STARTING, step=0), AttemptFacts(True, ago(9)), "RUNNING",
     [MarkRunning("every rank's train loop started (1 worker)")]),
    ("the workers' word wins over a Ray status that lags", JobFacts(S.STARTING, step=0),
     AttemptFacts(True, ago(9)), "PENDING", [MarkRunning("every rank's train loop started (1 worker)")]),
    ("not started, no report: waits", JobFacts(S.STARTING), AttemptFacts(True, ago(9)), "RUNNING",
     [Wait("Ray says RUNNING")]),
    ("running and reporting: nothing to do", JobFacts(S.RUNNING, step=9), AttemptFacts(True, ago(9)), "RUNNING",
     [Wait("Ray says RUNNING")]),
    ("succeeded", JobFacts(S.RUNNING), AttemptFacts(True, ago(9)), "SUCCEEDED",
     [Finish(R.SUCCEEDED, "SUCCEEDED", ray_status="SUCCEEDED", keep_logs=True)]),
    ("driver recorded why it failed", JobFacts(S.RUNNING), AttemptFacts(True, ago(9), R.OUT_OF_MEMORY), "FAILED",
     [Finish(R.OUT_OF_MEMORY, "FAILED", ray_status="FAILED", keep_logs=True)]),
    ("driver died silently: infra", JobFacts(S.RUNNING), AttemptFacts(True, ago(9)), "FAILED",
     [Finish(R.INFRA, "FAILED", ray_status="FAILED", keep_logs=True)]),
    ("cancel: stop until Ray ends it", JobFacts(S.CANCELLING), AttemptFacts(True, ago(9)), "RUNNING", [Stop()]),
    ("cancel: Ray stopped it", JobFacts(S.CANCELLING), AttemptFacts(True, ago(9)), "STOPPED",
     [Finish(R.CANCELLED, "STOPPED", ray_status="STOPPED", keep_logs=True)]),
    ("cancel raced a success: the true end wins", JobFacts(S.CANCELLING), AttemptFacts(True, ago(9)), "SUCCEEDED",
     [Finish(R.SUCCEEDED, "SUCCEEDED", ray_status="SUCCEEDED", keep_logs=True)]),
    ("cancel wins over a recorded failure", JobFacts(S.CANCELLING), AttemptFacts(True, ago(9), R.USER_ERROR),
     "FAILED", [Finish(R.CANCELLED, "FAILED", ray_status="FAILED", keep_logs=True)]),
    ("cancel beats timeout", JobFacts(S.CANCELLING, timeout_seconds=5), AttemptFacts(True, ago(9)), "RUNNING",
     [Stop()]),
    ("timeout stops the attempt", JobFacts(S.RUNNING, timeout_seconds=5), AttemptFacts(True, ago(9)), "RUNNING",
     [Stop(R.TIMEOUT, "ran past timeout_seconds=5")]),
    ("within timeout", JobFacts(S.RUNNING, timeout_seconds=50), AttemptFacts(True, ago(9)), "RUNNING",
     [Wait("Ray says RUNNING")]),
    ("timeout recorded, then Ray stopped it", JobFacts(S.RUNNING, timeout_seconds=5),
     AttemptFacts(True, ago(9), R.TIMEOUT), "STOPPED",
     [Finish(R.TIMEOUT, "STOPPED", ray_status="STOPPED", keep_logs=True)]),
    ("stopped by someone else: infra", JobFacts(S.RUNNING), AttemptFacts(True, ago(9)), "STOPPED",
     [Finish(R.INFRA, "STOPPED", ray_status="STOPPED", keep_logs=True)]),
    ("preemption asked, no checkpoint yet, within grace", JobFacts(S.RUNNING, preempt_requested_at=ago(10)),
     AttemptFacts(True, ago(99)), "RUNNING", [Wait("Ray says RUNNING")]),
    ("preemption: checkpointed since, stop", JobFacts(S.RUNNING, preempt_requested_at=ago(10),
     checkpointed_since_preempt=True), AttemptFacts(True, ago(99)), "RUNNING",
     [Stop(R.PREEMPTED, "stopped as asked: to make room for another job, or to grow")]),
    ("preemption: grace over, stop", JobFacts(S.RUNNING, preempt_requested_at=ago(61)), AttemptFacts(True, ago(99)),
     "RUNNING", [Stop(R.PREEMPTED, "stopped as asked: to make room for another job, or to grow")]),
    ("preempted job stopped: requeue reason", JobFacts(S.RUNNING, preempt_requested_at=ago(61)),
     AttemptFacts(True, ago(99), R.PREEMPTED), "STOPPED",
     [Finish(R.PREEMPTED, "STOPPED", ray_status="STOPPED", keep_logs=True)]),
    # The driver's own last word, sent once its run's result was final: the attempt ends on it, Ray still tearing down.
    ("driver said it succeeded, Ray still running: ends now", JobFacts(S.RUNNING, step=9),
     AttemptFacts(True, ago(9), R.SUCCEEDED, driver_ended=True), "RUNNING",
     [Finish(R.SUCCEEDED, "the driver's own account", log_later=True)]),
    ("driver said it failed, Ray still running: ends now", JobFacts(S.RUNNING, step=9),
     AttemptFacts(True, ago(9), R.USER_ERROR, driver_ended=True), "RUNNING",
     [Finish(R.USER_ERROR, "the driver's own account", log_later=True)]),
    ("driver's word before any report", JobFacts(S.STARTING), AttemptFacts(True, ago(9), R.OUT_OF_MEMORY,
     driver_ended=True), "RUNNING", [Finish(R.OUT_OF_MEMORY, "the driver's own account", log_later=True)]),
    ("driver's word found on adoption", JobFacts(S.RUNNING, step=9),
     AttemptFacts(False, ago(9), R.SUCCEEDED, driver_ended=True), "RUNNING",
     [MarkSubmitted(adopted=True), Finish(R.SUCCEEDED, "the driver's own account", log_later=True)]),
    ("cancel wins over the driver's failure", JobFacts(S.CANCELLING),
     AttemptFacts(True, ago(9), R.USER_ERROR, driver_ended=True), "RUNNING",
     [Finish(R.CANCELLED, "the driver's own account", log_later=True)]),
    ("the driver's success wins over a cancel", JobFacts(S.CANCELLING),
     AttemptFacts(True, ago(9), R.SUCCEEDED, driver_ended=True), "RUNNING",
     [Finish(R.SUCCEEDED, "the driver's own account", log_later=True)]),
    # A drain or a node loss costs no attempt once the dispatcher saw the node go: such a claim waits for Ray's end.
    ("driver claims its node drained, Ray still running: wait for Ray", JobFacts(S.RUNNING, step=9),
     AttemptFacts(True, ago(9), R.NODE_DRAINING, driver_ended=True), "RUNNING", [Wait("Ray says RUNNING")]),
    ("driver claims its node was lost, Ray still running: wait for Ray", JobFacts(S.RUNNING, step=9),
     AttemptFacts(True, ago(9), R.NODE_LOST, driver_ended=True), "RUNNING", [Wait("Ray says RUNNING")]),
    ("driver claimed a drain, then Ray ended: Ray's end, the claim its reason", JobFacts(S.RUNNING, step=9),
     AttemptFacts(True, ago(9), R.NODE_DRAINING, driver_ended=True), "FAILED",
     [Finish(R.NODE_DRAINING, "FAILED", ray_status="FAILED", keep_logs=True)]),
    ("driver's word, then Ray ended: Ray's end, log kept now", JobFacts(S.RUNNING, step=9),
     AttemptFacts(True, ago(9), R.SUCCEEDED, driver_ended=True), "SUCCEEDED",
     [Finish(R.SUCCEEDED, "SUCCEEDED", ray_status="SUCCEEDED", keep_logs=True)]),
    ("driver's word, then Ray forgot the job: the word stands", JobFacts(S.RUNNING, step=9),
     AttemptFacts(True, ago(9), R.SUCCEEDED, driver_ended=True), None,
     [Finish(R.SUCCEEDED, "the driver's own account", log_later=True)]),
    ("a stop of ours recorded first is not the driver's word: wait for Ray", JobFacts(S.RUNNING, timeout_seconds=5),
     AttemptFacts(True, ago(9), R.TIMEOUT), "RUNNING", [Stop(R.TIMEOUT, "ran past timeout_seconds=5")]),
    ("not our lease: hands off", JobFacts(S.RUNNING, leased_to_me=False), AttemptFacts(True, ago(9)), "FAILED",
     [Wait("held by another dispatcher")]),
    ("not our lease, not submitted: no submission", JobFacts(S.STARTING, leased_to_me=False),
     AttemptFacts(False, ago(1)), None, [Wait("held by another dispatcher")]),
]  # fmt: skip


@pytest.mark.parametrize(("name", "job", "attempt", "status", "expected"), ROWS, ids=[r[0] for r in ROWS])
def test_decide_table(
    name: str, job: JobFacts, attempt: AttemptFacts, status: str | None, expected: list[object]
) -> None:
    assert decide(job, attempt, ray(status), now=NOW, patience=PATIENCE) == expected


def test_runtime_env_failure_is_a_user_error() -> None:
    info = RayJobInfo("shunter-j1-1", "FAILED", message="pip failed", error_type="RUNTIME_ENV_SETUP_FAILED")
    actions = decide(JobFacts(S.STARTING), AttemptFacts(True, ago(9)), info, now=NOW, patience=PATIENCE)
    assert actions == [Finish(R.USER_ERROR, "pip failed", ray_status="FAILED", keep_logs=True)]


@pytest.mark.parametrize("state", [S.QUEUED, S.SUCCEEDED, S.FAILED, S.CANCELLED])
def test_states_outside_ray_are_left_alone(state: JobState) -> None:
    assert kinds(decide(JobFacts(state), AttemptFacts(True, ago(1)), ray("RUNNING"), now=NOW, patience=PATIENCE)) == [
        "Wait"
    ]


STATES = [S.STARTING, S.RUNNING, S.CANCELLING]
STATUSES = [None, "PENDING", "RUNNING", "SUCCEEDED", "FAILED", "STOPPED"]


@pytest.mark.parametrize(
    ("state", "status", "submitted", "leased", "timed_out", "preempt", "recorded", "spec_error", "waited"),
    list(itertools.product(STATES, STATUSES, [False, True], [False, True], [False, True],
                           ["none", "asked", "due"], [None, R.USER_ERROR], [None, "spec: bad"], [1, 500])),
)  # fmt: skip
def test_sweep_rules(
    state: JobState,
    status: str | None,
    submitted: bool,
    leased: bool,
    timed_out: bool,
    preempt: str,
    recorded: EndReason | None,
    spec_error: str | None,
    waited: float,
) -> None:
    job = JobFacts(
        state, leased_to_me=leased, step=1, timeout_seconds=0.5 if timed_out else None, spec_error=spec_error,
        preempt_requested_at=None if preempt == "none" else ago(10), checkpointed_since_preempt=preempt == "due",
    )  # fmt: skip
    actions = decide(job, AttemptFacts(submitted, ago(waited), recorded), ray(status), now=NOW, patience=PATIENCE)
    names = kinds(actions)
    # Exactly one decision ends the list, after at most one bookkeeping step.
    assert names[-1] in {"Wait", "Submit", "Stop", "Finish", "MarkRunning"}
    assert all(n == "MarkSubmitted" for n in names[:-1]) and len(names) <= 2
    if not leased:
        assert actions == [Wait("held by another dispatcher")]
        return
    terminal = status in ("SUCCEEDED", "FAILED", "STOPPED")
    if status is not None:
        assert "Submit" not in names  # never submit what Ray already has
        assert ("MarkSubmitted" in names) == (not submitted)
    if terminal:
        end = actions[-1]
        assert isinstance(end, Finish) and end.keep_logs and end.ray_status == status
        if status == "SUCCEEDED":
            assert end.reason is R.SUCCEEDED
        elif state is S.CANCELLING:
            assert end.reason is R.CANCELLED
    if state is S.CANCELLING:
        assert "MarkRunning" not in names and "Submit" not in names
        if status is not None and not terminal:
            assert actions[-1] == Stop()
    if "Submit" in names:
        assert status is None and not submitted and waited < PATIENCE.submit_seconds and spec_error is None
    if spec_error is not None:
        assert names[-1] in {"Finish", "Stop"}  # a job whose spec no longer validates never waits on
    if status in ("PENDING", "RUNNING") and state is not S.CANCELLING and spec_error is None:
        if preempt == "due":
            assert actions[-1] == Stop(R.PREEMPTED, "stopped as asked: to make room for another job, or to grow")
        elif timed_out:
            assert actions[-1] == Stop(R.TIMEOUT, "ran past timeout_seconds=0.5")


def test_classify_prefers_the_drivers_record_over_rays_guess() -> None:
    failed = RayJobInfo("s", "FAILED")
    assert classify(S.RUNNING, R.WORKER_LOST, failed) is R.WORKER_LOST
    assert classify(S.RUNNING, None, failed) is R.INFRA
    assert classify(S.RUNNING, R.WORKER_LOST, RayJobInfo("s", "SUCCEEDED")) is R.SUCCEEDED


HEAD, WORKER, ALIVE = "a" * 56, "b" * 56, "c" * 56
DEAD = {HEAD: True, WORKER: False}
DRIVER_ROWS = [
    # (name, job, Ray status, driver node, expected kinds and reason)
    ("driver on the restarted head: cluster_restarted", JobFacts(S.RUNNING, step=5), "RUNNING", HEAD,
     ("Finish", R.CLUSTER_RESTARTED)),
    ("driver on a dead worker node: node_lost", JobFacts(S.RUNNING, step=5), "RUNNING", WORKER,
     ("Finish", R.NODE_LOST)),
    ("starting, driver's node died: node_lost", JobFacts(S.STARTING), "PENDING", WORKER, ("Finish", R.NODE_LOST)),
    ("cancelling, driver's node died: cancelled (a stop would never land)", JobFacts(S.CANCELLING), "RUNNING", HEAD,
     ("Finish", R.CANCELLED)),
    ("driver on a live node: keep watching", JobFacts(S.RUNNING, step=5), "RUNNING", ALIVE, ("Wait", None)),
    ("driver not placed yet: keep watching", JobFacts(S.STARTING), "PENDING", None, ("Wait", None)),
    ("Ray already ended it: its own end wins", JobFacts(S.RUNNING), "SUCCEEDED", HEAD, ("Finish", R.SUCCEEDED)),
]  # fmt: skip


@pytest.mark.parametrize(("name", "job", "status", "node", "expected"), DRIVER_ROWS, ids=[r[0] for r in DRIVER_ROWS])
def test_a_driver_on_a_dead_node_ends_the_attempt(
    name: str, job: JobFacts, status: str, node: str | None, expected: tuple[str, R | None]
) -> None:
    info = RayJobInfo("shunter-j1-1", status, driver_node_id=node)
    actions = decide(job, AttemptFacts(True, ago(9)), info, now=NOW, patience=PATIENCE, dead_nodes=DEAD)
    last = actions[-1]
    assert (type(last).__name__, getattr(last, "reason", None)) == expected, actions
    if isinstance(last, Finish) and last.reason is not R.SUCCEEDED:
        assert node is not None and node[:12] in last.message, last.message


def test_the_drivers_last_word_beats_its_dead_node() -> None:
    """A driver that said its run succeeded, then lost its node while exiting: the run's result stands."""
    attempt = AttemptFacts(True, ago(9), R.SUCCEEDED, driver_ended=True)
    info = ray("RUNNING", driver_node_id=WORKER)
    actions = decide(JobFacts(S.RUNNING, step=5), attempt, info, now=NOW, patience=PATIENCE, dead_nodes={WORKER: False})
    assert actions == [Finish(R.SUCCEEDED, "the driver's own account", log_later=True)]


def test_without_a_node_table_nothing_is_presumed_dead() -> None:
    info = RayJobInfo("shunter-j1-1", "RUNNING", driver_node_id=HEAD)
    actions = decide(JobFacts(S.RUNNING, step=1), AttemptFacts(True, ago(9)), info, now=NOW, patience=PATIENCE)
    assert actions == [Wait("Ray says RUNNING")]


# ---- hang detection (service.policy.stall): a RUNNING attempt that reported, then went quiet
# ----------------------------
def quiet(seconds: float, *, after: float = 30, asked: float | None = None, ended: float | None = None,
          ran: bool = True, said: str | None = None) -> StallFacts:  # fmt: skip
    """Stall facts of an attempt quiet for `seconds` (timeout `after`), its stacks asked for `asked` s ago and the
    dump ended `ended` s ago."""
    return StallFacts(progress_at=ago(seconds), stall_after=after, why="stall_timeout_seconds=30",
                      stalled_at=None if asked is None else ago(asked),
                      dump_ended_at=None if ended is None else ago(ended), dump_ran=ran, dump_said=said)  # fmt: skip


DUMP = ("no progress report for 31s since step 3 (stall timeout 30s: stall_timeout_seconds=30); dumping every rank's "
        "Python stack into the attempt's log")  # fmt: skip
STALL_ROWS = [
    # (name, job facts, Ray status, expected actions)
    ("reporting: nothing to do", JobFacts(S.RUNNING, step=3, stall=quiet(29)), "RUNNING", [Wait("Ray says RUNNING")]),
    ("quiet past its timeout: stacks asked for", JobFacts(S.RUNNING, step=3, stall=quiet(31)), "RUNNING",
     [DumpStacks(DUMP, progress_at=ago(31))]),
    ("stacks asked for, dump running: wait", JobFacts(S.RUNNING, step=3, stall=quiet(40, asked=9)), "RUNNING",
     [Wait("stalled: waiting for every rank's stack to reach the attempt's log")]),
    ("dump just ended: its output gets time to reach the log", JobFacts(S.RUNNING, step=3,
     stall=quiet(40, asked=9, ended=1)), "RUNNING",
     [Wait("stalled: waiting for every rank's stack to reach the attempt's log")]),
    ("dump ended and settled: stop as stalled", JobFacts(S.RUNNING, step=3,
     stall=quiet(40, asked=9, ended=3, said="asked 2 process(es)")), "RUNNING",
     [Stop(R.STALLED, "no progress report for 40s since step 3; every rank's stack is in the attempt's log "
                      "(asked 2 process(es))")]),
    ("dump never ended: stopped all the same", JobFacts(S.RUNNING, step=3, stall=quiet(100, asked=60)), "RUNNING",
     [Stop(R.STALLED, "no progress report for 100s since step 3; the stack dump had not ended 60s after it was "
                      "asked for; the attempt's log holds what it printed")]),
    ("no dump ran: stopped once settled", JobFacts(S.RUNNING, step=3, stall=quiet(40, asked=5, ended=5, ran=False)),
     "RUNNING", [Stop(R.STALLED, "no progress report for 40s since step 3; no stack dump ran (the job's stack_dump "
                                 "event says why)")]),
    ("a report since the stacks were asked for: recovered", JobFacts(S.RUNNING, step=4,
     stall=quiet(2, asked=12, ended=8)), "RUNNING", [Wait("Ray says RUNNING")]),
    ("recovered, then quiet again: a stall of its own", JobFacts(S.RUNNING, step=3, stall=quiet(31, asked=50)),
     "RUNNING", [DumpStacks(DUMP, progress_at=ago(31))]),
    ("cancel wins over a stall", JobFacts(S.CANCELLING, step=3, stall=quiet(40, asked=9, ended=5)), "RUNNING",
     [Stop()]),
    ("timeout wins over a stall", JobFacts(S.RUNNING, step=3, timeout_seconds=5, stall=quiet(40, asked=9, ended=5)),
     "RUNNING", [Stop(R.TIMEOUT, "ran past timeout_seconds=5")]),
    ("a due preemption wins over a stall", JobFacts(S.RUNNING, step=3, preempt_requested_at=ago(61),
     stall=quiet(40, asked=9, ended=5)), "RUNNING",
     [Stop(R.PREEMPTED, "stopped as asked: to make room for another job, or to grow")]),
    ("Ray ended it meanwhile: its end wins", JobFacts(S.RUNNING, step=3, stall=quiet(40, asked=9, ended=5)),
     "FAILED", [Finish(R.INFRA, "FAILED", ray_status="FAILED", keep_logs=True)]),
    ("stopped by someone else before our stop: infra",
     JobFacts(S.RUNNING, step=3, stall=quiet(40, asked=9, ended=5)), "STOPPED",
     [Finish(R.INFRA, "STOPPED", ray_status="STOPPED", keep_logs=True)]),
]  # fmt: skip


@pytest.mark.parametrize(("name", "job", "status", "expected"), STALL_ROWS, ids=[r[0] for r in STALL_ROWS])
def test_stall_table(name: str, job: JobFacts, status: str, expected: list[object]) -> None:
    assert decide(job, AttemptFacts(True, ago(999)), ray(status), now=NOW, patience=PATIENCE) == expected


def test_a_recorded_stall_ends_the_attempt_as_stalled() -> None:
    job = JobFacts(S.RUNNING, step=3, stall=quiet(40, asked=9, ended=5))
    actions = decide(job, AttemptFacts(True, ago(999), R.STALLED), ray("STOPPED"), now=NOW, patience=PATIENCE)
    assert actions == [Finish(R.STALLED, "STOPPED", ray_status="STOPPED", keep_logs=True)]


@pytest.mark.parametrize(
    ("state", "status", "timed_out", "preempt", "spec_error", "phase"),
    list(itertools.product(STATES, STATUSES, [False, True], ["none", "asked", "due"], [None, "spec: bad"],
                           ["none", "reporting", "quiet", "settled"])),
)  # fmt: skip
def test_stall_sweep(
    state: JobState, status: str | None, timed_out: bool, preempt: str, spec_error: str | None, phase: str
) -> None:
    """Whatever the row: stacks are asked for and a stall stopped only on a RUNNING attempt Ray runs, with no cancel,
    no broken spec, no due preemption and no timeout to act on first."""
    stall = {"none": None, "reporting": quiet(5), "quiet": quiet(31), "settled": quiet(40, asked=9, ended=5)}[phase]
    job = JobFacts(
        state, step=3, timeout_seconds=0.5 if timed_out else None, spec_error=spec_error, stall=stall,
        preempt_requested_at=None if preempt == "none" else ago(10), checkpointed_since_preempt=preempt == "due",
    )  # fmt: skip
    actions = decide(job, AttemptFacts(True, ago(999)), ray(status), now=NOW, patience=PATIENCE)
    last = actions[-1]
    stalled = isinstance(last, DumpStacks) or (isinstance(last, Stop) and last.record is R.STALLED)
    free = (state is S.RUNNING and status in ("PENDING", "RUNNING") and not timed_out and preempt != "due"
            and spec_error is None)  # fmt: skip
    assert stalled == (free and phase in ("quiet", "settled")), actions
    if stalled:
        assert isinstance(last, DumpStacks) if phase == "quiet" else last.record is R.STALLED
