"""What the fair-share simulation (`bench.fairshare_sim`) runs and records, read by its report
(`bench.fairshare_report`): the jobs that arrive, a scenario, what one run saw, and the shares weights give."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from service.backends.sim import SimRun

START = datetime(2030, 1, 1, tzinfo=timezone.utc)  # far from today: a wall-clock read in the service shows at once


@dataclass(frozen=True)
class Arrival:
    owner: str
    team: str | None
    workers: int  # x 1 CPU
    seconds: float  # how long it runs once placed
    at: float | None = None  # seconds after the start; None: once its owner has fewer than `keep_waiting` waiting
    queue: str = "default"
    steps: int | None = None
    timeout: float | None = None  # timeout_seconds: all the estimate knows of a waiting job's length


@dataclass
class Scenario:
    name: str
    arrivals: list[Arrival]
    policy: dict[str, Any]  # Settings fields: fair_share, quotas, queues
    cpus: int = 16
    keep_waiting: int = 4  # each owner tops its waiting jobs up to this many, from its `at=None` arrivals
    tick: float = 1.0  # seconds between two rounds while the dispatchers still change something
    grace: float = 60.0  # preemption_grace_seconds
    max_jump: float = 300.0  # the clock never skips more (rolling windows, reservations age without an event)
    report_every: float = 120.0  # seconds between two progress reports of a running job

    def nodes(self) -> dict[str, dict[str, float]]:
        return {f"n{i}": {"CPU": 4.0, "memory": 64e9} for i in range(self.cpus // 4)}


def weight_shares(teams: dict[str, str | None], conf: dict[str, Any]) -> dict[str, float]:
    """Each owner's share by weight, as Fair Tree divides: its team's weight among the teams, then its own weight
    within its team (`conf`: the fair_share setting; an unnamed team or owner weighs 1)."""
    team_w, owner_w = conf.get("team_weights") or {}, conf.get("owner_weights") or {}
    members: dict[str, list[str]] = {}
    for owner, team in teams.items():
        members.setdefault(team or "", []).append(owner)
    total = sum(team_w.get(t, 1.0) for t in members)
    return {owner: team_w.get(team, 1.0) / total * owner_w.get(owner, 1.0) / sum(owner_w.get(o, 1.0) for o in owners)
            for team, owners in members.items() for owner in owners}  # fmt: skip


@dataclass
class Record:
    """What one simulated run saw, after every round (times: seconds after START)."""

    scenario: Scenario
    dispatchers: int
    samples: list[tuple[float, dict[str, list[float]], dict[str, list[float]]]] = field(default_factory=list)
    admitted: dict[str, float] = field(default_factory=dict)  # job -> first admission
    starts: dict[str, float] = field(default_factory=dict)  # job -> first admission after it was first seen waiting
    seen: dict[str, float] = field(default_factory=dict)  # job -> first seen waiting after a round
    estimates: dict[str, float | None] = field(default_factory=dict)  # job -> estimated start when first seen waiting
    jobs: dict[str, Arrival] = field(default_factory=dict)
    submitted: dict[str, float] = field(default_factory=dict)
    runs: list[SimRun] = field(default_factory=list)
    estimator: str | None = None  # why estimates were not taken, if not
    rounds: int = 0
    tick_failures: dict[str, int] = field(default_factory=dict)  # "Type: message" -> ticks that failed so
    wall_seconds: float = 0.0
    end: float = 0.0
