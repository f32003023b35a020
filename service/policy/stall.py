"""Hang detection's policy: how long a running attempt may go without a progress report before it is stalled, and
what the dispatcher then does. Pure: no I/O, no clock (`service.dispatch.stall_watch` gathers the facts;
`service.policy.reconcile` decides on them).

A stall is a hang after the loop has shown it trains: the clock starts at the attempt's first real progress report
(not at "every rank started", step 0), so a script that never reports is never called stalled (`timeout_seconds`
bounds that one). The timeout is the spec's `stall_timeout_seconds` when set; else it is derived from the attempt's
own pace: `stall_factor` times the longest recent interval between its reports, and never less than
`stall_min_seconds`. The interval from the attempt's start of training (every rank started) to its first report
counts while the history is short (`WINDOW` reports or fewer), so a loop that reports once per long epoch is judged by
an epoch's length from its first report on, not by the minimum alone.

Two phases, so the stacks reach the attempt's log before Ray stops it: `DumpStacks` (every rank's Python stack,
through faulthandler on SIGUSR1: `workers.stacks`) and, once that dump has ended and `STACK_SETTLE_SECONDS` more have
passed for its output to be forwarded to the driver's log (or `STACK_DUMP_SECONDS` after it was asked for, whatever
became of it), `Stop(stalled)`. A report after the stacks were asked for means it recovered: no stop.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

WINDOW = 20  # recent report intervals the derived timeout looks at
DUMP_SAID = "shunter-stacks:"  # the stack dump job's summary line (workers.stacks), read back for the end message
STACK_SETTLE_SECONDS = 3.0  # after the dump job ended: Ray's log monitor forwards worker output about once a second
STACK_DUMP_SECONDS = 60.0  # the stop comes this long after the stacks were asked for, even if the dump never ended


@dataclass(frozen=True)
class StallPolicy:
    """The operator's settings (`SHUNTER_STALL_*`): whether the derived default applies, and how it is derived."""

    detect: bool = True  # False: only a spec's own stall_timeout_seconds is watched
    min_seconds: float = 600.0
    factor: float = 10.0


@dataclass(frozen=True)
class StallFacts:
    """What `decide` needs of a RUNNING attempt that has reported at least once (None on `JobFacts` otherwise)."""

    progress_at: datetime  # its latest progress report
    stall_after: float  # seconds without a report that make it stalled
    why: str  # where `stall_after` comes from, for the event and the end message
    stalled_at: datetime | None = None  # when this stall's stacks were asked for (None, or before progress_at: none)
    dump_ended_at: datetime | None = None  # when the stack dump of this stall ended (None: still running)
    dump_said: str | None = None  # what the dump reported doing (its last log line), once it ended
    dump_ran: bool = True  # False: no dump job ran (refused, or a backend without processes); nothing to wait on


def longest_interval(times: Iterable[datetime]) -> float | None:
    """The longest gap between consecutive distinct times, in seconds; None with fewer than two."""
    ordered = sorted(set(times))
    gaps = [(b - a).total_seconds() for a, b in zip(ordered, ordered[1:], strict=False)]
    return max(gaps) if gaps else None


def stall_timeout(
    explicit: float | None, report_times: Iterable[datetime], policy: StallPolicy
) -> tuple[float, str] | None:
    """(seconds, why) for an attempt whose recent reports came at `report_times` (its start of training included
    while the history is short); None when it is not watched (no explicit timeout and the default turned off)."""
    if explicit is not None:
        return explicit, f"stall_timeout_seconds={explicit:g}"
    if not policy.detect:
        return None
    longest = longest_interval(report_times)
    if longest is None or policy.factor * longest <= policy.min_seconds:
        return policy.min_seconds, f"the minimum, SHUNTER_STALL_MIN_SECONDS={policy.min_seconds:g}"
    derived = policy.factor * longest
    return derived, f"{policy.factor:g} x its longest recent interval between reports, {longest:.0f}s"


def stacks_submission_id(submission_id: str, stalled_at: datetime) -> str:
    """The Ray Job that dumps one stall's stacks: one per stall (an attempt may recover and stall again), named by the
    attempt's own submission id and the stall's time, so asking again for the same stall adopts it."""
    return f"{submission_id}-stacks-{int(stalled_at.timestamp())}"


def quiet_seconds(facts: StallFacts, now: datetime) -> float:
    return (now - facts.progress_at).total_seconds()


def is_current(facts: StallFacts) -> bool:
    """Whether the stacks were asked for since the latest report (an older stall it recovered from does not count)."""
    return facts.stalled_at is not None and facts.stalled_at >= facts.progress_at


def dump_message(facts: StallFacts, *, step: int | None, now: datetime) -> str:
    quiet = quiet_seconds(facts, now)
    return (
        f"no progress report for {quiet:.0f}s since step {step} (stall timeout {facts.stall_after:g}s: {facts.why}); "
        "dumping every rank's Python stack into the attempt's log"
    )


def stop_message(facts: StallFacts, *, step: int | None, now: datetime, dump_done: bool) -> str:
    if not facts.dump_ran:
        where = "no stack dump ran (the job's stack_dump event says why)"
    elif dump_done:
        where = "every rank's stack is in the attempt's log" + (f" ({facts.dump_said})" if facts.dump_said else "")
    else:
        where = (f"the stack dump had not ended {STACK_DUMP_SECONDS:g}s after it was asked for; the attempt's log "
                 "holds what it printed")  # fmt: skip
    return f"no progress report for {quiet_seconds(facts, now):.0f}s since step {step}; {where}"
