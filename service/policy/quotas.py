"""What may run at once: queue limits, per-owner and per-team quotas, and cohorts that lend idle quota. Pure.

Every limit caps running jobs, CPUs and GPUs held by admitted jobs; a quota may also cap the GPUs of each accelerator
type (`max_gpus_by_type`, e.g. `{"H100": 8}`: what jobs asking for that type hold) and GPU-hours used in a rolling
window (`max_gpu_hours` over `window_hours`). Limits apply at several scopes at once, each counting the jobs
in it:

- a queue (`QueueLimit`: `max_running`, `max_cpus`, `max_gpus`);
- each owner and each team, cluster-wide (`SHUNTER_QUOTAS` `{"owner": {"*": {...}, "alice": {...}}, "team": ...}`;
  a named entry replaces `*` for that name);
- each owner and each team within one queue (the queue's `owner_quota` / `team_quota`).

A queue's `max_cpus` / `max_gpus` is its nominal quota. Queues of one `cohort` lend each other what they leave idle:
a queue may go past its nominal quota, by at most its `borrowing_limit`, while the cohort as a whole stays within the
sum of its members' nominal quotas. A lender that needs its quota back gets it by preemption of the borrowers
(`scheduler.reclaim`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from service.core.resources import accelerator_of

QUOTA_KEYS = ("max_running", "max_cpus", "max_gpus", "max_gpus_by_type", "max_gpu_hours", "window_hours")
LIMIT_KEYS = frozenset({"max_running", "max_cpus", "max_gpus", "preemption", "owner_quota", "team_quota", "cohort",
                        "borrowing_limit", "accelerator_types"})  # fmt: skip
RESOURCES = (("CPU", "cpus", "max_cpus"), ("GPU", "gpus", "max_gpus"))


@dataclass(frozen=True)
class Quota:
    """Caps for one owner or team (None: no cap). `max_gpu_hours` counts GPU-hours used in the last `window_hours`."""

    max_running: int | None = None
    max_cpus: float | None = None
    max_gpus: float | None = None
    # GPUs held by jobs asking for each accelerator type (`resources.accelerator_type`), e.g. {"H100": 8}: a type
    # not named has no cap of its own (`max_gpus` still counts it).
    max_gpus_by_type: dict[str, float] | None = field(default=None, hash=False)
    max_gpu_hours: float | None = None
    window_hours: float = 168.0

    @classmethod
    def parse(cls, value: Any, where: str) -> Quota:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: a mapping of {', '.join(QUOTA_KEYS)}")
        unknown = set(value) - set(QUOTA_KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}; known: {', '.join(QUOTA_KEYS)}")
        by_type = value.get("max_gpus_by_type")
        if by_type is not None:
            if not isinstance(by_type, dict) or not all(isinstance(k, str) and k for k in by_type):
                raise ValueError(f"{where}.max_gpus_by_type: a mapping of accelerator types to GPU counts")
            _nonnegative(by_type.items(), f"{where}.max_gpus_by_type")
            value = {**value, "max_gpus_by_type": {k: v for k, v in by_type.items() if v is not None}}
        _nonnegative(((k, v) for k, v in value.items() if k != "max_gpus_by_type"), where)
        if value.get("max_running") is not None and not isinstance(value["max_running"], int):
            raise ValueError(f"{where}.max_running: a whole number")
        if value.get("window_hours") is not None and value["window_hours"] <= 0:
            raise ValueError(f"{where}.window_hours: must be > 0")
        return cls(**{k: v for k, v in value.items() if v is not None})

    def as_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in QUOTA_KEYS}
        out["max_gpus_by_type"] = dict(self.max_gpus_by_type) if self.max_gpus_by_type else None
        return out


@dataclass(frozen=True)
class Quotas:
    """Cluster-wide quotas per owner and per team: a named entry, else `*`, else none."""

    owners: dict[str, Quota] = field(default_factory=dict)
    teams: dict[str, Quota] = field(default_factory=dict)

    @classmethod
    def parse(cls, value: dict[str, Any]) -> Quotas:
        unknown = set(value) - {"owner", "team"}
        if unknown:
            raise ValueError(f"quotas: unknown keys {sorted(unknown)}; known: owner, team")
        out: dict[str, dict[str, Quota]] = {}
        for scope in ("owner", "team"):
            entries = value.get(scope) or {}
            if not isinstance(entries, dict):
                raise ValueError(f"quotas.{scope}: a mapping of names (or '*') to quotas")
            out[scope] = {name: Quota.parse(q, f"quotas.{scope}.{name}") for name, q in entries.items()}
        return cls(owners=out["owner"], teams=out["team"])

    def of_owner(self, owner: str) -> Quota | None:
        return self.owners.get(owner, self.owners.get("*"))

    def of_team(self, team: str | None) -> Quota | None:
        return None if team is None else self.teams.get(team, self.teams.get("*"))


@dataclass(frozen=True)
class QueueLimit:
    """A named queue's caps (None: no cap), its per-owner/per-team quotas and its cohort."""

    max_running: int | None = None
    max_cpus: float | None = None
    max_gpus: float | None = None
    preemption: bool = False  # may its jobs preempt lower-priority running jobs of the queue?
    owner_quota: Quota | None = None
    team_quota: Quota | None = None
    cohort: str | None = None
    borrowing_limit: dict[str, float | None] = field(default_factory=dict)  # {"cpus", "gpus"}: None/absent = any
    accelerator_types: list[str] | None = None  # its jobs must ask for one of these (resources.accelerator_type)

    def nominal(self, resource: str) -> float | None:
        return self.max_cpus if resource == "CPU" else self.max_gpus if resource == "GPU" else None


def _nonnegative(pairs: Iterable[tuple[str, Any]], where: str) -> None:
    """Each value a number >= 0 or None (a bool is not a number here); ValueError naming the key."""
    for key, number in pairs:
        if number is not None and (isinstance(number, bool) or not isinstance(number, int | float) or number < 0):
            raise ValueError(f"{where}.{key}: a number >= 0 or null")


def parse_queue_limit(conf: dict[str, Any], where: str) -> QueueLimit:
    """A queue's limits from a mapping (`SHUNTER_QUEUES` entry); ValueError naming the key."""
    if not isinstance(conf, dict):
        raise ValueError(f"{where}: a mapping of limits")
    unknown = set(conf) - LIMIT_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
    values = dict(conf)
    for key in ("owner_quota", "team_quota"):
        if values.get(key) is not None:
            values[key] = Quota.parse(values[key], f"{where}.{key}")
    borrowing = values.get("borrowing_limit") or {}
    if not isinstance(borrowing, dict) or set(borrowing) - {"cpus", "gpus"}:
        raise ValueError(f"{where}.borrowing_limit: a mapping with 'cpus' and/or 'gpus'")
    values["borrowing_limit"] = dict(borrowing)
    # A cap that is not a number would only fail in admission, on every pass: refuse it here, naming the key.
    if values.get("max_running") is not None and (type(values["max_running"]) is not int):
        raise ValueError(f"{where}.max_running: a whole number >= 0 or null")
    numbers = [(k, values.get(k)) for k in ("max_running", "max_cpus", "max_gpus")]
    _nonnegative(numbers + [(f"borrowing_limit.{k}", v) for k, v in borrowing.items()], where)
    if not isinstance(values.get("preemption", False), bool):
        raise ValueError(f"{where}.preemption: true or false")
    if values.get("cohort") is not None and not isinstance(values["cohort"], str):
        raise ValueError(f"{where}.cohort: a name or null")
    kinds = values.get("accelerator_types")
    if kinds is not None and (not isinstance(kinds, list) or not kinds or not all(isinstance(k, str) for k in kinds)):
        raise ValueError(f"{where}.accelerator_types: a non-empty list of accelerator type names, or null")
    return QueueLimit(**values)


@dataclass
class Held:
    """What admitted jobs of one scope hold now."""

    running: int = 0
    cpus: float = 0.0
    gpus: float = 0.0
    gpus_by_type: dict[str, float] = field(default_factory=dict)  # GPUs of jobs asking for each accelerator type

    def add(self, total: dict[str, float], sign: int = 1) -> None:
        self.running += sign
        self.cpus += sign * total.get("CPU", 0.0)
        self.gpus += sign * total.get("GPU", 0.0)
        kind = accelerator_of(total)
        if kind is not None and total.get("GPU", 0.0):
            self.gpus_by_type[kind] = self.gpus_by_type.get(kind, 0.0) + sign * total["GPU"]

    def of(self, resource: str) -> float:
        return self.cpus if resource == "CPU" else self.gpus


QueueUsage = Held  # the name the queue overview and older callers use

Scope = tuple[str, ...]  # ("queue", q) | ("owner", o) | ("team", t) | ("queue-owner", q, o) | ("queue-team", q, t)


def scopes(queue: str, owner: str, team: str | None) -> list[Scope]:
    """Every scope a job of (queue, owner, team) counts in."""
    out: list[Scope] = [("queue", queue), ("owner", owner), ("queue-owner", queue, owner)]
    if team is not None:
        out += [("team", team), ("queue-team", queue, team)]
    return out


def describe(scope: Scope) -> str:
    kind = scope[0]
    if kind == "queue":
        return f"queue '{scope[1]}'"
    if kind in ("owner", "team"):
        return f"{kind} '{scope[1]}'"
    return f"{kind.split('-')[1]} '{scope[2]}' in queue '{scope[1]}'"


def _over(quota: Quota | QueueLimit, held: Held, total: dict[str, float], label: str, *, borrow: bool) -> str | None:
    if quota.max_running is not None and held.running + 1 > quota.max_running:
        return f"{label} is at its limit of {quota.max_running} running jobs"
    for resource, _, key in RESOURCES:
        cap = getattr(quota, key)
        if borrow or cap is None:
            continue
        if held.of(resource) + total.get(resource, 0.0) > cap + 1e-9:
            return f"{label} would exceed its {cap:g} {resource}s ({held.of(resource):g} in use)"
    kind = accelerator_of(total)
    caps: dict[str, float] = getattr(quota, "max_gpus_by_type", None) or {}
    if kind is not None and kind in caps and total.get("GPU", 0.0):
        used = held.gpus_by_type.get(kind, 0.0)
        if used + total["GPU"] > caps[kind] + 1e-9:
            return f"{label} would exceed its {caps[kind]:g} {kind} GPUs ({used:g} in use)"
    return None


def check(
    total: dict[str, float],
    queue: str,
    owner: str,
    team: str | None,
    *,
    limits: dict[str, QueueLimit],
    quotas: Quotas,
    held: dict[Scope, Held],
    gpu_hours: dict[Scope, float] | None = None,
) -> str | None:
    """Why a job holding `total` would break a limit now, or None. `gpu_hours`: GPU-hours used in each quota's window
    by scope (only scopes whose quota sets `max_gpu_hours` are looked up)."""
    limit = limits.get(queue)
    rules: list[tuple[Scope, Quota | None]] = [
        (("owner", owner), quotas.of_owner(owner)),
        (("team", team or ""), quotas.of_team(team)),
        (("queue-owner", queue, owner), limit.owner_quota if limit else None),
        (("queue-team", queue, team or ""), limit.team_quota if limit and team is not None else None),
    ]
    if limit is not None:
        why = _over(limit, held.get(("queue", queue), Held()), total, describe(("queue", queue)), borrow=True)
        if why:
            return why
        why = _queue_resources(total, queue, limits, held)
        if why:
            return why
    for scope, quota in rules:
        if quota is None:
            continue
        label = describe(scope)
        why = _over(quota, held.get(scope, Held()), total, label, borrow=False)
        if why:
            return why
        if quota.max_gpu_hours is not None and total.get("GPU", 0.0) > 0:
            used = (gpu_hours or {}).get(scope, 0.0)
            if used >= quota.max_gpu_hours - 1e-9:
                return (f"{label} has used {used:.1f} of its {quota.max_gpu_hours:g} GPU-hours in the last "
                        f"{quota.window_hours:g} h")  # fmt: skip
    return None


def _queue_resources(
    total: dict[str, float], queue: str, limits: dict[str, QueueLimit], held: dict[Scope, Held]
) -> str | None:
    """A queue's CPUs/GPUs: within its nominal quota, or borrowing within its limit from its cohort's idle quota."""
    limit = limits[queue]
    mine = held.get(("queue", queue), Held())
    for resource, word, _ in RESOURCES:
        cap, need = limit.nominal(resource), total.get(resource, 0.0)
        if cap is None or need == 0.0 or mine.of(resource) + need <= cap + 1e-9:
            continue
        label = f"queue '{queue}' would exceed its {cap:g} {resource}s ({mine.of(resource):g} in use)"
        if limit.cohort is None:
            return label
        most = limit.borrowing_limit.get(word)
        if most is not None and mine.of(resource) + need > cap + most + 1e-9:
            return f"{label} and may borrow at most {most:g} from cohort '{limit.cohort}'"
        idle = cohort_idle(limit.cohort, resource, limits, held)
        if need > idle + 1e-9:
            return f"{label} and cohort '{limit.cohort}' has {max(idle, 0.0):g} idle {resource}s to lend"
    return None


def cohort_idle(cohort: str, resource: str, limits: dict[str, QueueLimit], held: dict[Scope, Held]) -> float:
    """The cohort's nominal quota of `resource` not in use by its members. A member without a cap on it is not in
    that resource's pool: it lends none of it (and what it holds is its own)."""
    caps, used = 0.0, 0.0
    for name, limit in limits.items():
        cap = limit.nominal(resource)
        if limit.cohort != cohort or cap is None:
            continue
        caps += cap
        used += held.get(("queue", name), Held()).of(resource)
    return caps - used


def borrowed(queue: str, resource: str, limits: dict[str, QueueLimit], held: dict[Scope, Held]) -> float:
    """How much of `resource` a queue holds beyond its nominal quota (0 when it has none or is within it)."""
    cap = limits[queue].nominal(resource) if queue in limits else None
    return 0.0 if cap is None else max(0.0, held.get(("queue", queue), Held()).of(resource) - cap)


def count(
    held: dict[Scope, Held], total: dict[str, float], queue: str, owner: str, team: str | None, sign: int = 1
) -> None:
    for scope in scopes(queue, owner, team):
        held.setdefault(scope, Held()).add(total, sign)
