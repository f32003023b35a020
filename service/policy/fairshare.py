"""Fair share: in which order waiting jobs of equal priority are admitted. Pure: no I/O, no clock.

Usage is resource-seconds, weighted per resource (`resource_weights`, e.g. a GPU-second counts 10 CPU-seconds, and
`"GPU:H100": 30` an H100-second 30, for jobs asking for that accelerator type) and
decayed with a half-life, so last week's usage weighs less than this morning's. An attempt that held `r` weighted
resources from `s` to `e` (or to `now`, while it runs: a running job is usage already) adds

    U = r * H / ln 2 * (2^-((now - e) / H) - 2^-((now - s) / H))        (H: the half-life, in seconds)

which is the integral of `r * 2^-((now - t) / H)` over `[s, e]`. Among waiting jobs of equal priority the order is
Slurm's Fair Tree, two levels deep: first the team with the least usage per unit of weight (`team_weights`, default
1), then within it the owner with the least (`owner_weights`), then that owner's oldest job (FIFO within an owner).
Each job placed in the order counts, for the rest of the order, as if it had run `projection_seconds`, or its own
`timeout_seconds` where that is shorter (it cannot run longer): so two owners
with equal usage alternate instead of the earliest submitter taking every place, and one who used the cluster much
less gets the next few places, not all of them. A job already running counts the same way (LSF's run-job factor):
its owner will go on holding what it holds, so an owner whose first job has just started is not tied, on usage still
near zero, with one who holds nothing. Bounding the projection by the job's timeout matters: jobs of a few minutes
each counted as an hour made the order equalise what owners hold right now rather than what they used, and the
owner with the largest weight (who holds the most jobs at once) got 0.82-0.91 of its share in 100-job runs of
`bench/fairshare_sim.py`; bounded, 0.99-1.04.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, TypeVar

from service.core.resources import accelerator_of


def team_key(team: str | None, owner: str) -> str:
    """The tree's first level: a team, or an owner without one as a team of its own (weight 1), so that owners
    without teams share as owners, not as one team against each named team."""
    return team if team is not None else f"~{owner}"


@dataclass(frozen=True)
class FairShare:
    """The fair-share settings (`SHUNTER_FAIR_SHARE`)."""

    enabled: bool = True
    half_life_seconds: float = 24 * 3600.0
    resource_weights: dict[str, float] = field(default_factory=lambda: {"CPU": 1.0, "GPU": 10.0})
    team_weights: dict[str, float] = field(default_factory=dict)
    owner_weights: dict[str, float] = field(default_factory=dict)
    projection_seconds: float = 3600.0
    horizon_half_lives: float = 10.0  # usage older than this many half-lives (< 0.1%) is not read
    refresh_seconds: float = 30.0  # how long a process reuses the usage it read (service.store.standing.fair_usage)

    @classmethod
    def parse(cls, value: dict[str, Any]) -> FairShare:
        """From `SHUNTER_FAIR_SHARE`: enabled, half_life_hours, resource_weights, team_weights, owner_weights,
        projection_seconds (each optional). Raises ValueError naming the key."""
        known = {"enabled", "half_life_hours", "resource_weights", "team_weights", "owner_weights",
                 "projection_seconds", "refresh_seconds"}  # fmt: skip
        unknown = set(value) - known
        if unknown:
            raise ValueError(f"fair_share: unknown keys {sorted(unknown)}; known: {', '.join(sorted(known))}")
        out: dict[str, Any] = {}
        if "enabled" in value:
            if not isinstance(value["enabled"], bool):
                raise ValueError("fair_share.enabled: true or false")
            out["enabled"] = value["enabled"]
        pairs = (("half_life_hours", "half_life_seconds"), ("projection_seconds", "projection_seconds"),
                 ("refresh_seconds", "refresh_seconds"))  # fmt: skip
        for key, name in pairs:
            if key in value:
                number = value[key]
                if isinstance(number, bool) or not isinstance(number, int | float) or not 0 < number < 1e9:
                    raise ValueError(f"fair_share.{key}: a number > 0")
                out[name] = float(number) * (3600.0 if key == "half_life_hours" else 1.0)
        for key in ("resource_weights", "team_weights", "owner_weights"):
            if key in value:
                weights = value[key]
                if not isinstance(weights, dict) or not all(
                    isinstance(w, int | float) and not isinstance(w, bool) and 0 <= w < 1e9 for w in weights.values()
                ):
                    raise ValueError(f"fair_share.{key}: a mapping of names to numbers >= 0")
                out[key] = {str(k): float(w) for k, w in weights.items()}
        if out.get("resource_weights") is not None:
            out["resource_weights"] = {"CPU": 1.0, "GPU": 10.0, **out["resource_weights"]}
        return cls(**out)

    def rate(self, held: dict[str, float]) -> float:
        """Weighted resources per second of `held` (e.g. {"CPU": 4, "GPU": 1}). The GPUs of a job asking for an
        accelerator type weigh `resource_weights["GPU:<type>"]` where it is set (an H100-second may cost more than a
        T4-second), else `resource_weights["GPU"]`."""
        kind = accelerator_of(held)
        gpu = self.resource_weights.get(f"GPU:{kind}") if kind is not None else None
        return sum((gpu if k == "GPU" and gpu is not None else self.resource_weights.get(k, 0.0)) * v
                   for k, v in held.items())  # fmt: skip

    def team_weight(self, key: str) -> float:
        """A team's weight; an owner without a team stands at the team level with its own weight."""
        if key.startswith("~"):
            return self.owner_weight(key[1:])
        return max(self.team_weights.get(key, 1.0), 1e-9)

    def owner_weight(self, owner: str) -> float:
        return max(self.owner_weights.get(owner, 1.0), 1e-9)


@dataclass(frozen=True)
class Use:
    """One attempt's held resources over time (`end` None: still running)."""

    owner: str
    team: str | None
    held: dict[str, float]
    start: float
    end: float | None = None


def decayed(rate: float, start: float, end: float, now: float, half_life: float) -> float:
    """The decayed integral of `rate` over [start, end] seen at `now` (see the module docstring)."""
    if end <= start or rate == 0.0:
        return 0.0
    tau = half_life / math.log(2)
    return rate * tau * (math.exp(-(now - end) / tau) - math.exp(-(now - start) / tau))


@dataclass
class Usage:
    """Decayed usage per team and per owner."""

    teams: dict[str, float] = field(default_factory=dict)
    owners: dict[str, float] = field(default_factory=dict)

    def add(self, owner: str, team: str | None, amount: float) -> None:
        key = team_key(team, owner)
        self.teams[key] = self.teams.get(key, 0.0) + amount
        self.owners[owner] = self.owners.get(owner, 0.0) + amount


def usage_of(uses: Iterable[Use], now: float, config: FairShare) -> Usage:
    out = Usage()
    for use in uses:
        end = now if use.end is None else min(use.end, now)
        out.add(use.owner, use.team, decayed(config.rate(use.held), use.start, end, now, config.half_life_seconds))
    return out


class Waiting(Protocol):
    """What fair order needs of a queued job (`scheduler.Candidate` has it)."""

    @property
    def job_id(self) -> str: ...
    @property
    def priority(self) -> int: ...
    @property
    def seq(self) -> float: ...
    @property
    def owner(self) -> str: ...
    @property
    def team(self) -> str | None: ...

    @property
    def run_seconds(self) -> float | None: ...  # the longest it can run (its timeout), None: unbounded

    def total(self) -> dict[str, float]: ...


class Holding(NamedTuple):
    """An admitted job as fair order counts it: who holds what, for at most how much longer (None: unbounded)."""

    owner: str
    team: str | None
    total: dict[str, float]
    run_seconds: float | None = None


W = TypeVar("W", bound=Waiting)


def fair_order(
    candidates: Sequence[W],
    usage: Usage,
    config: FairShare,
    running: Iterable[Holding | tuple[str, str | None, dict[str, float]]] = (),
) -> list[W]:
    """Higher priority first; within a priority, Fair Tree by team then owner (see the module docstring); FIFO
    within an owner. Without fair share: priority, then FIFO. `running`: (owner, team, resources) of each admitted
    job, projected like a placed one."""
    fifo = sorted(candidates, key=lambda c: (-c.priority, c.seq, c.job_id))
    if not config.enabled:
        return fifo
    teams = dict(usage.teams)
    owners = dict(usage.owners)
    for held in running:
        owner, team, total, seconds = Holding(*held)
        projected = _projected(total, config, seconds)
        teams[team_key(team, owner)] = teams.get(team_key(team, owner), 0.0) + projected
        owners[owner] = owners.get(owner, 0.0) + projected
    out: list[W] = []
    start = 0
    while start < len(fifo):
        end = start
        while end < len(fifo) and fifo[end].priority == fifo[start].priority:
            end += 1
        out.extend(_tree(fifo[start:end], teams, owners, config))
        start = end
    return out


def _tree(level: list[W], teams: dict[str, float], owners: dict[str, float], config: FairShare) -> list[W]:
    """One priority level in fair order; `teams`/`owners` grow by each placed job's projection."""
    queues: dict[str, dict[str, list[W]]] = {}
    for cand in reversed(level):  # each owner's list ends with its oldest job: pop() takes it
        queues.setdefault(team_key(cand.team, cand.owner), {}).setdefault(cand.owner, []).append(cand)
    out: list[W] = []
    while queues:
        # Ties go to the team with the oldest waiting job (FIFO, as between owners), not to the smallest name.
        team = min(
            queues,
            key=lambda t: (teams.get(t, 0.0) / config.team_weight(t), min(q[-1].seq for q in queues[t].values()), t),
        )
        members = queues[team]
        owner = min(members, key=lambda o: (owners.get(o, 0.0) / config.owner_weight(o), members[o][-1].seq, o))
        cand = members[owner].pop()
        out.append(cand)
        projected = _projected(cand.total(), config, cand.run_seconds)
        teams[team] = teams.get(team, 0.0) + projected
        owners[owner] = owners.get(owner, 0.0) + projected
        if not members[owner]:
            del members[owner]
            if not members:
                del queues[team]
    return out


def _projected(total: dict[str, float], config: FairShare, run_seconds: float | None = None) -> float:
    # At least one unit per second: a job of unweighted resources only still takes its turn.
    seconds = config.projection_seconds
    if run_seconds is not None:
        seconds = min(max(run_seconds, 0.0), seconds)
    return max(config.rate(total), 1.0) * seconds


def shares(usage: Usage, config: FairShare) -> dict[str, dict[str, float]]:
    """Each owner's usage and its share of all usage (for `GET /v1/queues`), with the owner's normalised usage."""
    total = sum(usage.owners.values())
    return {
        owner: {
            "usage": used,
            "share": used / total if total > 0 else 0.0,
            "weight": config.owner_weight(owner),
        }
        for owner, used in sorted(usage.owners.items())
    }
