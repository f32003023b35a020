"""The numbers of issue 15's proof at scale, from one simulated run (`bench.fairshare_sim.Record`): each owner's
share of resource-seconds against its weight, the peak of every quota against its limit, how long a lender waited
for its borrowed quota, how close `estimated_start` came to the real start. Kept apart from the driver so the test
asserts exactly what the CLI prints.
"""

from __future__ import annotations

from statistics import median
from typing import Any

from bench.fairshare_model import START, Record, weight_shares

USE_KEYS = ("max_running", "max_cpus", "max_gpus")  # index into a sample's [running, cpus, gpus]
ESTIMATE_TOLERANCE = 0.25


def summarise(rec: Record) -> dict[str, Any]:
    """Quotas and borrowing are judged on what ran on the cluster at each instant; `quotas_admitted` is the same on
    what the database counted as admitted (it still counts a preempted job from its stop until its end is recorded)."""
    running = running_use(rec)
    cpu_seconds = sum(r.workers * r.per_worker.get("CPU", 0.0) * ((r.ended or _abs(rec.end)) - r.placed)
                      for r in rec.runs if r.placed is not None)  # fmt: skip
    return {
        "scenario": rec.scenario.name,
        "jobs": len(rec.jobs),
        "dispatchers": rec.dispatchers,
        "rounds": rec.rounds,
        "tick_failures": rec.tick_failures,
        "wall_seconds": round(rec.wall_seconds, 2),
        "simulated_hours": round(rec.end / 3600, 2),
        "utilisation": round(cpu_seconds / max(rec.scenario.cpus * rec.end, 1e-9), 3),
        "placed_late": sum(1 for r in rec.runs if r.placed is not None and r.placed > r.submitted + 1e-6),
        "shares": shares(rec),
        "quotas": quota_peaks(rec, running),
        "quotas_admitted": quota_peaks(rec, [use for _, use, _ in rec.samples]),
        "borrowing": borrowing(rec, running),
        "estimates": estimate_accuracy(rec),
    }


def _abs(seconds: float) -> float:
    return START.timestamp() + seconds


def _windows(rec: Record) -> list[tuple[float, float]]:
    """The stretches of time in which every owner had a job waiting (merged, in order)."""
    owners = {a.owner for a in rec.jobs.values()}
    out: list[tuple[float, float]] = []
    for (t, _, waiting), (t_next, _, _) in zip(rec.samples, rec.samples[1:], strict=False):
        if all(waiting.get(f"owner:{o}") for o in owners):
            if out and abs(out[-1][1] - t) < 1e-9:
                out[-1] = (out[-1][0], t_next)
            else:
                out.append((t, t_next))
    return out


def _weight_shares(rec: Record) -> dict[str, float]:
    teams = {a.owner: a.team for a in rec.jobs.values()}
    return weight_shares(teams, rec.scenario.policy.get("fair_share") or {})


def shares(rec: Record) -> dict[str, Any]:
    """Weighted resource-seconds each owner held while every owner had jobs waiting, against its weight share."""
    weights = (rec.scenario.policy.get("fair_share") or {}).get("resource_weights") or {"CPU": 1.0}
    windows = [(_abs(a), _abs(b)) for a, b in _windows(rec)]
    used: dict[str, float] = {}
    for run in rec.runs:
        if run.placed is None:
            continue
        rate = sum(weights.get(k, 0.0) * v for k, v in run.total().items())
        end = run.ended if run.ended is not None else _abs(rec.end)
        overlap = sum(max(0.0, min(end, b) - max(run.placed, a)) for a, b in windows)
        owner = rec.jobs[run.job_id].owner
        used[owner] = used.get(owner, 0.0) + rate * overlap
    total = sum(used.values())
    owners = {}
    for owner, expected in sorted(_weight_shares(rec).items()):
        share = used.get(owner, 0.0) / total if total else 0.0
        owners[owner] = {"resource_seconds": round(used.get(owner, 0.0)), "share": round(share, 4),
                         "weight_share": round(expected, 4), "ratio": round(share / expected, 3)}  # fmt: skip
    window = sum(b - a for a, b in windows)
    deviation = max((abs(o["ratio"] - 1) for o in owners.values()), default=None)
    return {"window_seconds": round(window), "window_fraction": round(window / max(rec.end, 1e-9), 3),
            "owners": owners, "max_deviation": deviation}  # fmt: skip


def running_use(rec: Record) -> list[dict[str, list[float]]]:
    """At each sample's instant, what ran on the cluster ([jobs, CPUs, GPUs]) by owner, team and queue."""
    changes = sorted([(r.placed, 1, r) for r in rec.runs if r.placed is not None] +
                     [(r.ended, -1, r) for r in rec.runs if r.placed is not None and r.ended is not None],
                     key=lambda c: (c[0], c[1]))  # fmt: skip
    now: dict[str, list[float]] = {}
    out, i = [], 0
    for t, _, _ in rec.samples:
        while i < len(changes) and changes[i][0] <= _abs(t) + 1e-6:
            _, sign, run = changes[i]
            arrival, total = rec.jobs[run.job_id], run.total()
            for key in (f"owner:{arrival.owner}", f"team:{arrival.team}", f"queue:{arrival.queue}"):
                held = now.setdefault(key, [0.0, 0.0, 0.0])
                held[0] += sign
                held[1] += sign * total.get("CPU", 0.0)
                held[2] += sign * total.get("GPU", 0.0)
            i += 1
        out.append({k: list(v) for k, v in now.items()})
    return out


def quota_peaks(rec: Record, uses: list[dict[str, list[float]]]) -> dict[str, Any]:
    """The most each quota'd owner, team and queue held at any instant (`uses`: one map per sample), against its
    limit; a cohort's members together against the sum of their nominal quotas."""
    policy = rec.scenario.policy
    limits: dict[str, dict[str, float]] = {}
    names = {"owner": {a.owner for a in rec.jobs.values()}, "team": {a.team for a in rec.jobs.values() if a.team}}
    for scope, entries in (policy.get("quotas") or {}).items():
        for name in names.get(scope, ()):
            quota = entries.get(name, entries.get("*"))
            if quota:
                limits[f"{scope}:{name}"] = {k: v for k, v in quota.items() if k in USE_KEYS and v is not None}
    cohorts: dict[str, float] = {}
    for name, conf in (policy.get("queues") or {}).items():
        cap = {k: conf[k] for k in USE_KEYS if conf.get(k) is not None}
        if conf.get("cohort") and "max_cpus" in cap:
            cap["max_cpus"] += (conf.get("borrowing_limit") or {}).get("cpus") or 0.0
            cohorts[conf["cohort"]] = cohorts.get(conf["cohort"], 0.0) + conf["max_cpus"]
        limits[f"queue:{name}"] = cap
    peaks: dict[str, dict[str, float]] = {}
    for use in uses:
        for scope in limits:
            held = use.get(scope, [0.0, 0.0, 0.0])
            for i, key in enumerate(USE_KEYS):
                peak = peaks.setdefault(scope, {})
                peak[key] = max(peak.get(key, 0.0), held[i])
        for cohort, cap in cohorts.items():
            members = [q for q, c in (policy.get("queues") or {}).items() if c.get("cohort") == cohort]
            cpus = sum(use.get(f"queue:{q}", [0.0, 0.0, 0.0])[1] for q in members)
            peak = peaks.setdefault(f"cohort:{cohort}", {})
            peak["max_cpus"] = max(peak.get("max_cpus", 0.0), cpus)
            limits[f"cohort:{cohort}"] = {"max_cpus": cap}
    exceeded, binding = [], []
    for scope, cap in limits.items():
        for key, limit in cap.items():
            peak = peaks.get(scope, {}).get(key, 0.0)
            if peak > limit + 1e-9:
                exceeded.append(f"{scope} {key}: {peak:g} > {limit:g}")
            elif peak >= limit - 1e-9:
                binding.append(f"{scope} {key}")
    return {"limits": limits, "peaks": peaks, "exceeded": exceeded, "reached": binding}


def borrowing(rec: Record, uses: list[dict[str, list[float]]]) -> dict[str, Any]:
    """Episodes in which a cohort queue had waiting work within its nominal quota while another member borrowed;
    each lasts until that is no longer so. One preemption cycle: the grace, then stop, finish and admit (3 ticks)."""
    queues = rec.scenario.policy.get("queues") or {}
    cohort = {q: c for q, c in queues.items() if c.get("cohort") and c.get("max_cpus") is not None}
    if not cohort:
        return {}
    cycle = rec.scenario.grace + 3 * rec.scenario.tick
    open_since: dict[str, float] = {}
    episodes: list[float] = []
    for (t, _, waiting), use in zip(rec.samples, uses, strict=True):
        held = {q: use.get(f"queue:{q}", [0.0, 0.0, 0.0])[1] for q in cohort}
        for q, conf in cohort.items():
            needs = waiting.get(f"queue:{q}") or []
            lent = any(held[r] > cohort[r]["max_cpus"] + 1e-9 for r in cohort
                       if r != q and cohort[r]["cohort"] == conf["cohort"])  # fmt: skip
            owed = lent and bool(needs) and held[q] + min(needs) <= conf["max_cpus"] + 1e-9
            if owed:
                open_since.setdefault(q, t)
            elif q in open_since:
                episodes.append(t - open_since.pop(q))
    episodes += [rec.end - t for t in open_since.values()]
    return {"episodes": len(episodes), "max_seconds": max(episodes, default=0.0), "cycle_seconds": cycle,
            "seconds": sorted(episodes), "within_one_cycle": all(e <= cycle + 1e-6 for e in episodes)}  # fmt: skip


def estimate_accuracy(rec: Record) -> dict[str, Any]:
    """Of the jobs that waited, the share whose estimate (taken when first seen waiting) was within 25% of the wait
    that followed (and never stricter than two ticks: admission itself happens on a tick). Also apart: the jobs that
    no later submission overtook, for which the estimate had the whole queue it would start behind."""
    if rec.estimator:
        return {"skipped": rec.estimator}
    overtaken = _overtaken(rec)
    counts = {"all": [0, 0], "not_overtaken": [0, 0]}  # [jobs, within]
    missing, errors, early = 0, [], 0
    for job_id, seen in rec.seen.items():
        real, guess = rec.starts.get(job_id), rec.estimates.get(job_id)
        if real is None:
            continue
        wait = real - seen
        ok = guess is not None and abs(guess - real) <= max(ESTIMATE_TOLERANCE * wait, 2 * rec.scenario.tick)
        missing += guess is None
        if guess is not None:
            errors.append((guess - real) / max(wait, rec.scenario.tick))
            early += not ok and guess < real
        for key in ("all", "not_overtaken") if job_id not in overtaken else ("all",):
            counts[key][0] += 1
            counts[key][1] += ok
    share = {k: round(w / n, 3) if n else None for k, (n, w) in counts.items()}
    return {"jobs": counts["all"][0], "within_25pct": counts["all"][1], "share_within": share["all"],
            "not_overtaken": {"jobs": counts["not_overtaken"][0], "share_within": share["not_overtaken"]},
            "no_estimate": missing, "too_early": early, "started_at_once": len(rec.jobs) - len(rec.seen),
            "median_relative_error": round(median(errors), 3) if errors else None}  # fmt: skip


def _overtaken(rec: Record) -> set[str]:
    """Jobs that a job submitted after they were first seen waiting started ahead of."""
    out, latest = set(), -1.0  # the latest submission among jobs started so far (strictly earlier)
    by_start = sorted((rec.starts.get(j, t), j) for j, t in rec.admitted.items())
    i = 0
    while i < len(by_start):
        same = [j for t, j in by_start[i:] if t == by_start[i][0]]
        out.update(j for j in same if j in rec.seen and latest > rec.seen[j])
        latest = max(latest, *(rec.submitted.get(j, -1.0) for j in same))
        i += len(same)
    return out


def render(summary: dict[str, Any]) -> str:
    """The summary as the CLI prints it."""
    lines = [f"== {summary['scenario']}: {summary['jobs']} jobs, {summary['dispatchers']} dispatcher(s), "
             f"{summary['simulated_hours']} h simulated in {summary['wall_seconds']} s ({summary['rounds']} rounds), "
             f"utilisation {summary['utilisation']:.0%}"]  # fmt: skip
    for failure, count in summary["tick_failures"].items():
        lines.append(f"!! {count} dispatcher ticks failed: {failure}")
    shares = summary["shares"]
    lines.append(f"share of resource-seconds while every owner waited ({shares['window_fraction']:.0%} of the run):")
    for owner, s in shares["owners"].items():
        lines.append(f"  {owner:8} {s['share']:6.1%} vs weight {s['weight_share']:6.1%}  ratio {s['ratio']:.2f}")
    quotas = summary["quotas"]
    for scope, cap in quotas["limits"].items():
        peak = quotas["peaks"].get(scope, {})
        lines.append(f"  peak {scope:14} " + ", ".join(f"{k} {peak.get(k, 0):g}/{v:g}" for k, v in cap.items()))
    lines.append(f"quota exceeded by what ran: {quotas['exceeded'] or 'never'}; by what the database counted "
                 f"admitted: {summary['quotas_admitted']['exceeded'] or 'never'}")  # fmt: skip
    if summary["borrowing"]:
        b = summary["borrowing"]
        lines.append(f"borrowed quota returned: {b['episodes']} episodes, longest {b['max_seconds']:.0f} s "
                     f"(one preemption cycle: {b['cycle_seconds']:.0f} s)")  # fmt: skip
    est = summary["estimates"]
    lines.append(f"estimates: {est['skipped']}" if "skipped" in est else
                 f"estimated_start within 25%: {est['within_25pct']}/{est['jobs']} ({est['share_within'] or 0:.0%}), "
                 f"none given {est['no_estimate']}, median relative error {est['median_relative_error']}; "
                 f"not overtaken by later submissions: {est['not_overtaken']['share_within'] or 0:.0%} of "
                 f"{est['not_overtaken']['jobs']}")  # fmt: skip
    return "\n".join(lines)
