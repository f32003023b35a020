"""A chaos run against a real deployment on this machine: PostgreSQL, an external Ray head, two `shunter api` and
two `shunter dispatcher` processes. Many short checkpointing jobs run while random shunter processes are SIGKILLed
at random moments (and started again), and the Ray head is killed and started again once, during which shunter
reconnects without a restart of its own (its APIs say Ray is why they are not ready, then are ready again, every
process the same). Then the invariants:

- every job SUCCEEDED, at its last step;
- no training step ran twice within an attempt, and each later attempt started right after a complete checkpoint of
  an earlier one that shunter lists (reported by the attempt that wrote it or, that report lost with a killed head,
  by the attempt that restored it) at a step an earlier attempt reached, or from scratch (the jobs' own traces: rank
  0 appends "<attempt> <step>" after each step). How many
  resumed from an older checkpoint than the newest one shunter listed is a figure (`resumed_behind`), not a failure:
  see the note in `check`;
- no Ray submission id was used twice (Ray's job list before the head restart and at the end, and shunter's events);
- no lease is held by a process that is gone: sampled all through the run, an active job's lease never stays past
  its expiry (its owner was killed) for longer than a takeover takes, and at the end no row names a dead owner.

`tests/service/test_chaos.py` runs a CI-sized one; `bench/chaos.py` the long one (100 kills over 50 jobs).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import text

from service.backends.ray_local import free_port
from service.store.db import make_engine
from tests.external_ray import ExternalHead

REPO = Path(__file__).resolve().parents[1]
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


@dataclass
class Process:
    """One shunter process the run may kill and start again (an API keeps its port across restarts)."""

    name: str
    args: list[str]
    env: dict[str, str]
    log_dir: Path
    url: str | None = None
    popen: subprocess.Popen[bytes] | None = None
    pids: list[int] = field(default_factory=list)  # every pid it has had

    def start(self) -> None:
        log = open(self.log_dir / f"{self.name}.log", "ab")  # noqa: SIM115 - the child keeps it
        self.popen = subprocess.Popen(self.args, env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                      start_new_session=True)  # fmt: skip
        self.pids.append(self.popen.pid)

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill9(self) -> None:
        if self.popen is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=30)

    def stop(self) -> None:
        if self.alive():
            assert self.popen is not None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill9()

    def ready(self) -> bool:
        if self.url is None:
            return self.alive()
        try:
            return httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False


@dataclass
class ChaosReport:
    jobs: int
    steps_per_job: int
    seconds: float
    kills: Counter[str]
    head_restarts: int
    attempts: int
    end_reasons: Counter[str]
    resumed_attempts: int  # later attempts that started from a checkpoint
    resumed_behind: int  # ... from an older one than the newest complete checkpoint shunter listed
    steps_run: int  # every step any attempt ran (the traces)
    steps_rerun: int  # steps run again after a resume (lost since the last checkpoint)
    submissions: int
    problems: list[str]

    def summary(self) -> dict[str, Any]:
        return {
            "jobs": self.jobs, "steps_per_job": self.steps_per_job, "seconds": round(self.seconds, 1),
            "kills": dict(self.kills), "kills_total": sum(self.kills.values()), "head_restarts": self.head_restarts,
            "attempts": self.attempts, "end_reasons": dict(self.end_reasons),
            "resumed_attempts": self.resumed_attempts, "resumed_behind": self.resumed_behind,
            "steps_run": self.steps_run, "steps_rerun": self.steps_rerun,
            "rerun_fraction": round(self.steps_rerun / max(self.steps_run, 1), 4), "ray_submissions": self.submissions,
            "problems": self.problems,
        }  # fmt: skip


class Chaos:
    def __init__(self, work: Path, pg_url: str, *, seed: int, jobs: int, kills: int, steps: int = 30,
                 checkpoint_every: int = 5, step_sleep: float = 0.1, gap: tuple[float, float] = (1.0, 6.0),
                 head_cpus: int = 3, head_restart: bool = True) -> None:  # fmt: skip
        self.work, self.pg_url = work, pg_url
        self.rng = random.Random(seed)
        self.n_jobs, self.n_kills, self.steps = jobs, kills, steps
        self.checkpoint_every, self.step_sleep, self.gap = checkpoint_every, step_sleep, gap
        self.head = ExternalHead(num_cpus=head_cpus)
        self.head_restart = head_restart
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.processes: list[Process] = []
        self.kills: Counter[str] = Counter()
        self.head_restarts = 0
        self.ray_ids_before_restart: list[str] = []
        self.job_ids: list[str] = []
        self.traces: dict[str, Path] = {}
        self.lease_problems: dict[str, str] = {}  # job id -> the first stale lease seen on it
        self.restart_problems: list[str] = []  # what the head restart found wrong in shunter's reconnection
        self.lease_samples = 0

    # ---- the deployment -----------------------------------------------------------------------------------------
    def _env(self, name: str, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SHUNTER_")}
        env.update({
            "SHUNTER_DATABASE_URL": self.pg_url, "SHUNTER_RAY_ADDRESS": self.head.gcs_address,
            "SHUNTER_RAY_DASHBOARD_URL": self.head.dashboard_url,
            "SHUNTER_STORAGE_URI": str(self.work / "checkpoints"), "SHUNTER_DATA_DIR": str(self.work / name),
            "SHUNTER_DISPATCHER_TICK_SECONDS": "0.25", "SHUNTER_LEASE_SECONDS": "5",
            # Two dispatchers on one machine: the second would warn that the first has the metrics port.
            "SHUNTER_DISPATCHER_METRICS_PORT": "0", "PYTHONUNBUFFERED": "1", **extra,
        })  # fmt: skip
        return env

    def start(self) -> None:
        apis = []
        for i in (1, 2):
            port = free_port()
            env = self._env(f"api{i}", SHUNTER_PORT=str(port))
            api = Process(f"api{i}", [sys.executable, "-m", "api.cli", "api"], env, self.logs,
                          url=f"http://127.0.0.1:{port}")  # fmt: skip
            apis.append(api)
        # The first API creates the schema while the head starts (it waits for Ray only to say it is ready); the
        # rest start against that schema.
        apis[0].start()
        self.head.start()
        self._wait(apis[0].ready, 90, "api1 ready")
        apis[1].start()
        dispatchers = [
            Process(f"dispatcher{i}", [sys.executable, "-m", "api.cli", "dispatcher"],
                    self._env(f"dispatcher{i}", SHUNTER_PUBLIC_URL=str(apis[i - 1].url)), self.logs)
            for i in (1, 2)
        ]  # fmt: skip
        for d in dispatchers:
            d.start()
        self.processes = [*apis, *dispatchers]
        for api in apis:
            self._wait(api.ready, 90, f"{api.name} ready")

    def stop(self) -> None:
        for p in self.processes:
            p.stop()
        self.head.kill()

    @staticmethod
    def _wait(predicate: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.25)
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")

    def _api(self, path: str, *, method: str = "GET", patience: float = 60.0, **kwargs: Any) -> Any:
        """Call whichever API answers (they may be down: that is the point), retrying until `patience` runs out."""
        deadline = time.monotonic() + patience
        while True:
            for p in self.rng.sample(self.processes[:2], 2):
                try:
                    r = httpx.request(method, f"{p.url}{path}", timeout=10, **kwargs)
                except httpx.HTTPError:
                    continue
                if r.status_code < 500:
                    r.raise_for_status()
                    return r.json()
            if time.monotonic() > deadline:
                raise AssertionError(f"no API answered {method} {path} within {patience:g}s")
            time.sleep(0.5)

    # ---- the run ------------------------------------------------------------------------------------------------
    def submit_all(self) -> None:
        for i in range(self.n_jobs):
            trace = self.work / "traces" / f"job-{i}.txt"
            trace.parent.mkdir(exist_ok=True)
            spec = {
                "name": f"chaos-{i}", "entrypoint": {"callable": "examples.mlp:train_loop"},
                "resources": {"num_workers": 1},
                "config": {"total_steps": self.steps, "checkpoint_every": self.checkpoint_every, "report_every": 1,
                           "step_sleep": self.step_sleep, "trace_path": str(trace), "seed": i},
                "retries": {"max_attempts": 10, "backoff_seconds": 1},
            }  # fmt: skip
            # The same Idempotency-Key on a retry: a POST whose answer was lost with a killed API is not doubled.
            job = self._api("/v1/jobs", method="POST", json=spec, headers={"Idempotency-Key": f"chaos-{i}"})
            self.job_ids.append(job["id"])
            self.traces[job["id"]] = trace

    def ended(self) -> int:
        items = self._api("/v1/jobs", params={"limit": 500})["items"]
        return sum(j["state"] in TERMINAL for j in items if j["id"] in self.traces)

    def checkpointed_running(self) -> bool:
        """Some job is RUNNING with a complete checkpoint of its current attempt: a head restart now cuts into
        training that has something to resume from."""
        running = self._api("/v1/jobs", params={"limit": 500, "state": "RUNNING"})["items"]
        for job in running:
            if (job.get("step") or 0) >= self.steps:
                continue  # done training, only finishing: a restart now would cut nothing
            checkpoints = self._api(f"/v1/jobs/{job['id']}/checkpoints")
            if any(c["complete"] and c["attempt"] == job["attempt"] for c in checkpoints):
                return True
        return False

    def restart_head(self) -> None:
        """Kill the head and start it again at the same address (a new cluster: Ray's job table is gone, as after a
        KubeRay head pod restart). shunter reconnects without being restarted: the APIs say why they are not ready
        meanwhile (503, Ray named), and every shunter process that was up before the kill is the same process once
        the APIs are ready again. Kills pause meanwhile (the run is one loop)."""
        self.ray_ids_before_restart = self._ray_ids()
        before = {p.name: p.popen.pid for p in self.processes if p.popen is not None and p.alive()}
        self.head.kill()
        said: list[str] = []

        def not_ready_for_ray() -> bool:
            for api in self.processes[:2]:
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    r = httpx.get(f"{api.url}/readyz", timeout=5)
                    if r.status_code == 503:
                        said.append(r.json()["why"].get("ray", ""))
                        return True
            return False

        self._wait(not_ready_for_ray, 30, "an API's /readyz to say Ray is not ready")
        if not said[-1].startswith("not ready: Ray"):
            self.restart_problems.append(f"/readyz during the head restart did not name Ray: {said[-1]!r}")
        time.sleep(self.rng.uniform(0.5, 1.5))
        self.head.start()
        for api in self.processes[:2]:
            self._wait(api.ready, 90, f"{api.name} ready again after the head restart")
        after = {p.name: p.popen.pid for p in self.processes if p.popen is not None and p.alive()}
        if after != before:
            self.restart_problems.append(f"shunter processes restarted or gone over the head restart: {before} -> "
                                         f"{after}")  # fmt: skip
        self.head_restarts += 1

    def _ray_ids(self) -> list[str]:
        r = httpx.get(f"{self.head.dashboard_url}/api/jobs/", timeout=30)
        return [j["submission_id"] for j in r.json() if (j.get("submission_id") or "").startswith("shunter-")]

    def run(self, *, timeout: float) -> ChaosReport:
        started = time.monotonic()
        self.submit_all()
        head_at = self.rng.randint(max(1, self.n_kills // 3), max(1, (2 * self.n_kills) // 3))
        done_kills = 0
        deadline = started + timeout
        while done_kills < self.n_kills and time.monotonic() < deadline:
            gap_ends = time.monotonic() + self.rng.uniform(*self.gap)
            if done_kills >= head_at and self.head_restart and not self.head_restarts:
                # Due: watch the whole gap, not only its end, for a moment mid-training (some running job has a
                # checkpoint of its attempt to resume from); a job's window is a few seconds at the CI size.
                while time.monotonic() < gap_ends and not self.checkpointed_running():
                    time.sleep(0.2)
                if time.monotonic() < gap_ends:
                    self.restart_head()
            time.sleep(max(gap_ends - time.monotonic(), 0.0))
            victim = self.rng.choice(self.processes)
            victim.kill9()
            self.kills[victim.name.rstrip("0123456789")] += 1
            done_kills += 1
            time.sleep(self.rng.uniform(0.2, 2.0))
            victim.start()
            self.sample_leases()
            if self.ended() == self.n_jobs and done_kills >= self.n_kills // 2:
                break  # everything ended early: no more moments to kill at
        if self.head_restart and not self.head_restarts:
            with contextlib.suppress(AssertionError):
                self._wait(lambda: self.checkpointed_running() or self.ended() == self.n_jobs, 600, "a checkpoint")
            self.restart_head()
        for p in self.processes:
            self._wait(p.ready, 90, f"{p.name} ready after the last kill")
        self._wait(lambda: self.sample_leases() or self.ended() == self.n_jobs, max(deadline - time.monotonic(), 60),
                   "every job to end")  # fmt: skip
        return self.check(time.monotonic() - started)

    # ---- the invariants -----------------------------------------------------------------------------------------
    def check(self, seconds: float) -> ChaosReport:
        problems: list[str] = []
        reasons: Counter[str] = Counter()
        attempts_total = resumed = resumed_behind = steps_run = steps_rerun = 0
        submitted_events: Counter[tuple[str, int]] = Counter()
        for job_id in self.job_ids:
            job = self._api(f"/v1/jobs/{job_id}")
            if (job["state"], job["step"]) != ("SUCCEEDED", self.steps):
                problems.append(f"{job_id}: {job['state']} at step {job['step']}: {job.get('last_error')}")
            attempts = self._api(f"/v1/jobs/{job_id}/attempts")
            attempts_total += len(attempts)
            reasons.update(a["end_reason"] or "none" for a in attempts)
            restored = set()  # attempts that said which checkpoint Ray Train restored for them
            for e in self._api(f"/v1/jobs/{job_id}/events"):
                if e["reason"] == "ray_job_submitted":
                    submitted_events[(job_id, e.get("attempt") or 0)] += 1
                if e["reason"] == "checkpoint_restored":
                    restored.add(e.get("attempt"))
            # An attempt resumed at the final step trains nothing and leaves no trace: its restore event counts it.
            resumed += len(
                {a["number"] for a in attempts if a["number"] > 1} & restored - set(by_attempt_of(self.traces[job_id]))
            )
            checkpoints = [c for c in self._api(f"/v1/jobs/{job_id}/checkpoints") if c["complete"]]
            by_attempt = by_attempt_of(self.traces[job_id])
            highest = 0
            for attempt in sorted(by_attempt):
                steps = by_attempt[attempt]
                steps_run += len(steps)
                if steps != list(range(steps[0], steps[0] + len(steps))):
                    problems.append(f"{job_id} attempt {attempt}: steps not run once each in order: {steps}")
                # A complete checkpoint of an earlier attempt, as shunter lists it: reported by that attempt, or
                # (its report lost) by this one, which restored it before its first step (`report_restored`).
                saved = {
                    c["step"]
                    for c in checkpoints
                    if c["step"] is not None
                    and (c["attempt"] < attempt or (c["attempt"] == attempt and c["step"] < steps[0]))
                }
                reached = {s for a, earlier in by_attempt.items() if a < attempt for s in earlier}
                if steps[0] - 1 not in saved | {0}:
                    problems.append(f"{job_id} attempt {attempt}: started at step {steps[0]}, which follows no "
                                    f"complete checkpoint of an earlier attempt ({sorted(saved)})")  # fmt: skip
                elif steps[0] > 1 and steps[0] - 1 not in reached:
                    problems.append(f"{job_id} attempt {attempt}: resumed from step {steps[0] - 1}, which no earlier "
                                    f"attempt reached")  # fmt: skip
                if steps[0] > 1:
                    resumed += 1
                    if attempt not in restored:
                        problems.append(f"{job_id} attempt {attempt}: resumed at step {steps[0]} without saying "
                                        f"which checkpoint it restored")  # fmt: skip
                if steps[0] - 1 < max(saved, default=0):
                    # Resumed from an older checkpoint than the newest shunter lists: Ray Train restores its run from
                    # its own record, which a head killed between a checkpoint's report and that record misses.
                    resumed_behind += 1
                steps_rerun += max(0, min(highest, steps[-1]) - steps[0] + 1)
                highest = max(highest, steps[-1])
        twice = {k: n for k, n in submitted_events.items() if n > 1}
        if twice:
            problems.append(f"submitted twice (shunter's events): {twice}")
        ray_ids = self.ray_ids_before_restart + self._ray_ids()
        doubled = [s for s, n in Counter(ray_ids).items() if n > 1]
        if doubled:
            problems.append(f"Ray submission ids used twice: {doubled}")
        problems += self.dead_leases() + list(self.lease_problems.values()) + self.restart_problems
        if not self.lease_samples:
            problems.append("leases were never sampled during the run")
        return ChaosReport(
            jobs=self.n_jobs, steps_per_job=self.steps, seconds=seconds, kills=self.kills,
            head_restarts=self.head_restarts, attempts=attempts_total, end_reasons=reasons, resumed_attempts=resumed,
            resumed_behind=resumed_behind,
            steps_run=steps_run, steps_rerun=steps_rerun, submissions=len(ray_ids), problems=problems,
        )  # fmt: skip

    STALE_AFTER = 20.0  # seconds past a lease's expiry: far more than a takeover takes (a tick of another dispatcher)

    def sample_leases(self) -> bool:
        """Note every active job whose lease expired more than STALE_AFTER seconds ago and is still held: its owner
        is gone (or stuck) and nobody took the job over. Returns False, so it can ride along a wait's predicate."""
        engine = make_engine(self.pg_url)
        try:
            with engine.connect() as conn:
                rows = conn.execute(text(
                    "SELECT id, lease_owner, EXTRACT(EPOCH FROM now() - lease_expires_at) FROM jobs "
                    "WHERE lease_owner IS NOT NULL AND state IN ('STARTING', 'RUNNING', 'CANCELLING') "
                    "AND lease_expires_at < now() - make_interval(secs => :stale)"), {"stale": self.STALE_AFTER},
                ).all()  # fmt: skip
        finally:
            engine.dispose()
        self.lease_samples += 1
        for job_id, owner, late in rows:
            self.lease_problems.setdefault(job_id, f"{job_id}: lease of {owner} expired {late:.0f}s ago, still held")
        return False

    def dead_leases(self) -> list[str]:
        """Leases whose owner (`<host>:<pid>`) is not a live dispatcher process of this run (an ended job holds none:
        service.lifecycle.state clears the lease with the end state)."""
        live = {p.popen.pid for p in self.processes if p.name.startswith("dispatcher") and p.alive() and p.popen}
        engine = make_engine(self.pg_url)
        try:
            with engine.connect() as conn:
                rows = conn.execute(text("SELECT id, lease_owner FROM jobs WHERE lease_owner IS NOT NULL")).all()
        finally:
            engine.dispose()
        return [f"{job_id}: leased to {owner}, not a live dispatcher" for job_id, owner in rows
                if int(owner.rsplit(":", 1)[1]) not in live]  # fmt: skip


def dump(report: ChaosReport, path: Path) -> None:
    path.write_text(json.dumps(report.summary(), indent=2) + "\n")


def by_attempt_of(trace: Path) -> dict[int, list[int]]:
    """A job's trace: the steps each attempt ran, in order."""
    by_attempt: dict[int, list[int]] = {}
    for line in trace.read_text().splitlines() if trace.exists() else []:
        attempt, step = line.split()
        by_attempt.setdefault(int(attempt), []).append(int(step))
    return by_attempt
