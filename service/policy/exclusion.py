"""Nodes kept out: of one job's retries when its attempts failed there, of everyone's admissions when several jobs did.

An attempt's end names the node at fault when it can (`NodeFault` rows, written with the end): a failed pre-flight
check names the rank's node; a lost worker or a collective timeout names the node Ray's error gives. The decisions
(`for_job`, `for_everyone`) are pure and table-tested, here; admission reads them through
`service.lifecycle.node_faults.excluded`, where the fault rows are written and read, and keeps the named nodes out
of the job's placement, and the driver out of Ray's (a label selector on `ray.io/node-id`). An admin's clear lets a
node back in for everyone at once.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from service.core.enums import EndReason

NODE_ID = re.compile(r"node_id='([0-9a-f]{16,64})'")
LOST_NODES = re.compile(r"Lost nodes: ([0-9a-f, ]+)\.")
# Ends whose named node is kept out: one failed pre-flight is enough; a lost worker or a timed-out collective, which
# a job's own bug can also cause, only when it happens again on the same node.
AT_ONCE = frozenset({EndReason.PREFLIGHT_FAILED.value})
REPEATED = frozenset({EndReason.WORKER_LOST.value, EndReason.COLLECTIVE_TIMEOUT.value})
RECORDED = AT_ONCE | REPEATED | {EndReason.NODE_LOST.value}


@dataclass(frozen=True)
class Fault:
    node_id: str
    job_id: str
    reason: str  # an EndReason value
    at: datetime
    address: str | None = None
    owner: str | None = None  # the job's owner: everyone's exclusion needs faults of `Rules.owners` distinct owners


@dataclass(frozen=True)
class Rules:
    repeats: int = (
        2  # a lost worker or collective timeout on one node this many times keeps it out of the job's retries
    )
    jobs: int = 3  # this many distinct jobs' faults on one node within `cooldown` keep it out of everyone's admissions
    cooldown: timedelta = timedelta(minutes=30)
    # ... and those jobs must belong to this many distinct owners: a job is arbitrary code and its end message is its
    # own to write, so one user's jobs alone could otherwise name a healthy node and keep it from everyone.
    owners: int = 1


def named_nodes(reason: str, message: str) -> list[str]:
    """The nodes an attempt's end names as at fault (for the ends that are recorded)."""
    if reason not in RECORDED:
        return []
    found = NODE_ID.findall(message or "")
    for listed in LOST_NODES.findall(message or ""):
        found += [n.strip() for n in listed.split(",") if n.strip()]
    return list(dict.fromkeys(found))


def _why(reason: str, count: int) -> str:
    if reason in AT_ONCE:
        return "failed the pre-flight check"
    return f"{count} attempts ended {reason} there"


def for_job(faults: Iterable[Fault], rules: Rules) -> dict[str, str]:
    """Node id -> why, for the nodes one job's retries keep off (its own uncleared faults)."""
    counts: dict[tuple[str, str], int] = {}
    for f in faults:
        counts[f.node_id, f.reason] = counts.get((f.node_id, f.reason), 0) + 1
    out: dict[str, str] = {}
    for (node, reason), count in sorted(counts.items()):
        if reason in AT_ONCE or (reason in REPEATED and count >= rules.repeats):
            out.setdefault(node, _why(reason, count))
    return out


@dataclass(frozen=True)
class Excluded:
    node_id: str
    why: str
    jobs: tuple[str, ...]
    until: datetime
    address: str | None = None


def for_everyone(faults: Iterable[Fault], rules: Rules, *, now: datetime) -> dict[str, Excluded]:
    """Nodes on which `rules.jobs` distinct jobs of `rules.owners` distinct owners failed within the cool-down: out
    of every admission until the cool-down has passed since the latest of them (or an admin clears them)."""
    by_node: dict[str, list[Fault]] = {}
    for f in faults:
        if f.at > now - rules.cooldown and f.reason in AT_ONCE | REPEATED:
            by_node.setdefault(f.node_id, []).append(f)
    out = {}
    for node, seen in sorted(by_node.items()):
        jobs = tuple(sorted({f.job_id for f in seen}))
        owners = {f.owner for f in seen}
        if len(jobs) >= rules.jobs and len(owners) >= rules.owners:
            reasons = sorted({f.reason for f in seen})
            address = next((f.address for f in seen if f.address), None)
            out[node] = Excluded(node, f"{len(jobs)} jobs failed there ({', '.join(reasons)})", jobs,
                                 max(f.at for f in seen) + rules.cooldown, address)  # fmt: skip
    return out
