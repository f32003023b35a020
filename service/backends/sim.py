"""A simulated cluster for proving scheduling policy at scale (bench/fairshare_sim.py): finite nodes, jobs that last,
and the service's clock (a `service.core.clock.VirtualClock` in a simulation), so thousands of jobs and hours of cluster
time go through the real dispatchers and admission code in a minute.

`NoopJobs` ends every job at once on unlimited CPUs, which cannot show fair share, quotas or preemption. Here a job
holds its worker group (the spec's per-worker resources x num_workers, packed onto nodes as Ray packs a placement
group; never a node over-committed) from the moment it is placed until `SIM_SECONDS` (from the job's
`runtime_env.env_vars`) later; one that does not fit stays PENDING until it does, as Ray keeps it. `stop()` (a cancel,
a preemption) ends it STOPPED at once. Its workers report through the real progress code (`service.lifecycle.reports`,
as the internal API calls it): every rank started, then with `SIM_STEPS`, the step and `total_steps`. It stands in for
Ray only in simulations of the queue; never where Ray's own behaviour is under test.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from sqlalchemy.engine import Engine
from sqlmodel import Session

from service.core import clock, resources
from service.core.backend import SUBMISSION_PREFIX, ClusterView, LogPiece, NodeView, RayJobInfo, chunks_of, piece_of
from service.core.errors import InfraError
from service.lifecycle import reports
from service.spec.job import JobSpec
from service.store.models import Job

SECONDS_ENV = "SIM_SECONDS"  # how long the job runs once placed
STEPS_ENV = "SIM_STEPS"  # how many steps it reports over that time (none: it reports only that it started)
DEFAULT_SECONDS = 60.0


@dataclass
class SimRun:
    """One submission (one attempt) and what it holds."""

    submission_id: str
    job_id: str
    attempt: int
    per_worker: dict[str, float]
    workers: int
    placement: str
    seconds: float
    steps: int | None
    submitted: float  # timestamps in the service's clock, seconds
    placed: float | None = None
    ended: float | None = None
    status: str = "PENDING"  # PENDING | RUNNING | SUCCEEDED | STOPPED
    held: list[tuple[str, dict[str, float]]] = field(default_factory=list)  # (node, resources) per worker
    reported_started: bool = False
    reported_step: int | None = None
    reported_at: float = -math.inf

    @property
    def ends(self) -> float | None:
        return None if self.placed is None or self.ended is not None else self.placed + self.seconds

    def total(self) -> dict[str, float]:
        return resources.scaled(self.per_worker, self.workers)


class SimJobs:
    """The `Backend` protocol on a simulated cluster of `nodes` ({node id: {"CPU": 8, "GPU": 1, ...}})."""

    dashboard_url = "sim://"
    gcs_address = None

    def __init__(
        self,
        nodes: dict[str, dict[str, float]],
        *,
        engine: Engine,
        now: Callable[[], datetime] = clock.now,
        report_every: float = 30.0,
    ) -> None:
        self.nodes = {name: dict(total) for name, total in nodes.items()}
        self.engine = engine  # where the job's spec is read, and where its workers' progress lands
        self._now = now
        self.report_every = report_every  # seconds of the clock between two progress reports of one job
        self._lock = threading.Lock()
        self._runs: dict[str, SimRun] = {}
        self._pending: list[SimRun] = []  # in submission order
        self._running: set[str] = set()
        self._free = {name: dict(total) for name, total in nodes.items()}
        self.changes = 0  # submissions, placements, ends and stops so far: the simulation sees the cluster move

    # ---- the Backend protocol ---------------------------------------------------------------------------------
    def close(self) -> None:
        pass

    def ping(self) -> bool:
        return True

    def problem(self) -> str | None:
        return None

    def info(self, submission_id: str) -> RayJobInfo | None:
        with self._lock:
            self._catch_up()
            run = self._runs.get(submission_id)
            if run is None:
                return None
            return RayJobInfo(submission_id, run.status, message=f"sim {run.status.lower()}",
                              start_time=_ms(run.placed), end_time=_ms(run.ended))  # fmt: skip

    def submit(
        self, *, submission_id: str, entrypoint: str, runtime_env: dict[str, Any], metadata: dict[str, str]
    ) -> bool:
        env = runtime_env.get("env_vars") or {}
        try:
            job_id, attempt = env["SHUNTER_JOB_ID"], int(env["SHUNTER_ATTEMPT"])
            seconds = float(env.get(SECONDS_ENV, DEFAULT_SECONDS))
            steps = int(env[STEPS_ENV]) if env.get(STEPS_ENV) else None
        except (KeyError, ValueError) as exc:
            raise InfraError(f"sim backend: cannot read the submission's environment: {exc}") from exc
        with self._lock:
            if submission_id in self._runs:
                return False  # adopted, as Ray refuses a second job of one id
        spec = self._spec(job_id)
        res = spec.resources
        with self._lock:
            if submission_id in self._runs:
                return False
            self._catch_up()
            now = self._stamp()
            workers = res.workers(int(env["SHUNTER_WORLD_SIZE"]) if env.get("SHUNTER_WORLD_SIZE") else None)
            run = SimRun(submission_id, job_id, attempt, res.per_worker(), workers, res.placement.value,
                         seconds, steps, submitted=now)  # fmt: skip
            self._runs[submission_id] = run
            self._pending.append(run)
            self.changes += 1
            self._place_pending(now)
        return True

    def stop(self, submission_id: str) -> bool:
        with self._lock:
            self._catch_up()
            run = self._runs.get(submission_id)
            if run is None or run.ended is not None:
                return False
            now = self._stamp()
            self._end(run, "STOPPED", now)
            self._place_pending(now)
            return True

    def logs(self, submission_id: str) -> str | None:
        with self._lock:
            run = self._runs.get(submission_id)
            return None if run is None else f"sim job {submission_id}: {run.status}\n"

    def log_range(self, submission_id: str, start: int, length: int) -> LogPiece | None:
        return piece_of(self.logs(submission_id), start, length)

    def log_stream(self, submission_id: str, start: int, end: int | None) -> Iterator[bytes] | None:
        return chunks_of(self.logs(submission_id), start, end)

    def dump_stacks(self, submission_id: str, *, dump_id: str) -> str:
        return "a simulated job has no processes: there are no stacks to dump"

    def list_submission_ids(self, prefix: str = SUBMISSION_PREFIX) -> list[str]:
        with self._lock:
            return sorted(s for s in self._runs if s.startswith(prefix))

    def cluster(self) -> ClusterView:
        with self._lock:
            self._catch_up()
            free = {name: {k: max(v, 0.0) for k, v in room.items()} for name, room in self._free.items()}
            views = [NodeView(name, f"sim/{name}", True, dict(total), free[name]) for name, total in self.nodes.items()]
        return ClusterView(nodes=views)

    # ---- for the simulation driver ----------------------------------------------------------------------------
    def next_end(self) -> float | None:
        """When the next placed job ends (clock seconds), or None."""
        with self._lock:
            ends = [e for s in self._running if (e := self._runs[s].ends) is not None]
            return min(ends) if ends else None

    def runs(self) -> list[SimRun]:
        """Every submission so far (copies), after bringing them up to the clock."""
        with self._lock:
            self._catch_up()
            return [replace(r, held=list(r.held)) for r in self._runs.values()]

    def deliver_progress(self) -> int:
        """What the workers of placed jobs report by now, through `service.lifecycle.reports` as the internal API takes
        it: every rank started (once), then the step and `total_steps` every `report_every` seconds. Returns the reports
        written. Called by the simulation between dispatcher rounds, as the workers of a real cluster report on their
        own; never under this backend's lock, so no dispatcher call waits on a database write of ours."""
        with self._lock:
            self._catch_up()
            now = self._stamp()
            due = []
            for run in (self._runs[s] for s in sorted(self._running)):
                step = None
                if run.steps:
                    placed = now if run.placed is None else run.placed  # a running run is placed
                    step = min(run.steps, int(run.steps * (now - placed) / max(run.seconds, 1e-9)))
                fresh = step is not None and step != run.reported_step and now - run.reported_at >= self.report_every
                if not run.reported_started or fresh:
                    due.append((run, not run.reported_started, step if fresh else None))
                    run.reported_started = True
                    if fresh:
                        run.reported_step, run.reported_at = step, now
        for run, started, step in due:
            if started:
                reports.record_started(self.engine, job_id=run.job_id, attempt=run.attempt)
            if step is not None:
                reports.record_report(self.engine, job_id=run.job_id, attempt=run.attempt,
                                       metrics={"step": step, "total_steps": run.steps})  # fmt: skip
        return len(due)

    # ---- the cluster's own course (under the lock) ------------------------------------------------------------
    def _stamp(self) -> float:
        return self._now().timestamp()

    def _spec(self, job_id: str) -> JobSpec:
        """The job's resources come from its spec, as the driver reads it from the API."""
        with Session(self.engine) as session:
            job = session.get(Job, job_id)
        if job is None:
            raise InfraError(f"sim backend: no job {job_id}")
        return JobSpec.model_validate(job.spec)

    def _catch_up(self) -> None:
        """End every job whose time is up, in order, placing pending ones as room frees (at the time it frees)."""
        now = self._stamp()
        while True:
            due = [r for s in self._running if (e := (r := self._runs[s]).ends) is not None and e <= now]
            if not due:
                return
            run = min(due, key=lambda r: (r.ends, r.submission_id))
            at = run.ends
            assert at is not None
            self._end(run, "SUCCEEDED", at)
            self._place_pending(at)

    def _end(self, run: SimRun, status: str, at: float) -> None:
        run.status, run.ended = status, at
        self.changes += 1
        self._running.discard(run.submission_id)
        if run in self._pending:
            self._pending.remove(run)
        for node, amount in run.held:
            for key, value in amount.items():
                self._free[node][key] = self._free[node].get(key, 0.0) + value

    def _place_pending(self, at: float) -> None:
        """Place waiting submissions in the order they came, each whole or not at all (a placement group)."""
        for run in list(self._pending):
            if run.submitted > at:
                break
            nodes = self._fit(run)
            if nodes is None:
                continue
            for node in nodes:
                resources.take(self._free[node], run.per_worker)
            run.held = [(node, dict(run.per_worker)) for node in nodes]
            run.status, run.placed = "RUNNING", at
            self._pending.remove(run)
            self._running.add(run.submission_id)
            self.changes += 1

    def _fit(self, run: SimRun) -> list[str] | None:
        """A node per worker, as Ray places a placement group: pack on as few nodes as it can (the fullest node that
        holds the whole group, else worker by worker onto the fullest that fits); spread onto the emptiest;
        strict_pack on one node only; strict_spread on distinct nodes."""
        free = {name: dict(room) for name, room in self._free.items()}
        if run.placement in ("pack", "strict_pack"):
            whole = run.total()
            homes = [n for n, room in free.items() if resources.fits(room, whole)]
            if homes:
                return [min(homes, key=lambda n: sum(free[n].get(k, 0.0) for k in whole))] * run.workers
            if run.placement == "strict_pack":
                return None
        chosen: list[str] = []
        for _ in range(run.workers):
            fitting = [n for n, room in free.items() if resources.fits(room, run.per_worker)]
            if run.placement == "strict_spread":
                fitting = [n for n in fitting if n not in chosen]
            if not fitting:
                return None
            left = {n: sum(free[n].get(k, 0.0) for k in run.per_worker) for n in fitting}
            spread = run.placement in ("spread", "strict_spread")
            node = max(fitting, key=left.__getitem__) if spread else min(fitting, key=left.__getitem__)
            resources.take(free[node], run.per_worker)
            chosen.append(node)
        return chosen


def _ms(at: float | None) -> int | None:
    return None if at is None else int(at * 1000)
