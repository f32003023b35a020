"""Prometheus metrics. Counts come from the database at scrape time, so they are right whichever process (one
`serve`, or many `api` and `dispatcher` processes) did the work; timings of this process are in-process histograms.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from datetime import datetime

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import func
from sqlalchemy.engine import Engine
from sqlalchemy.orm import aliased
from sqlmodel import Session, col, select

from service.store.models import ClusterSnapshot, Job, JobEvent, JobState, utcnow
from service.tenancy import usage

QUEUE_WAIT_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 4 * 3600.0, 24 * 3600.0)


class InProcess(Collector):
    """Exposes module-level metrics (observed outside the API) in an app's own registry."""

    def __init__(self, *metrics: Histogram) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        for metric in self.metrics:
            yield from metric.collect()


class DatabaseCollector(Collector):
    """Jobs by state and queue, admissions, retries by reason, queue wait, resource-seconds: read from SQL at each
    scrape."""

    def __init__(self, engine: Engine, *, last_tick: Callable[[], float | None] | None = None) -> None:
        self.engine = engine
        self.last_tick = last_tick
        self._resource_high_water: dict[tuple[str, str, str], float] = {}

    def collect(self) -> Iterator[Metric]:
        with Session(self.engine) as session:
            yield _jobs_by_state(session)
            yield _admissions(session)
            yield _retries(session)
            yield _queue_wait(session)
            yield self._resource_seconds(session)
            yield from _cluster(session)
        if self.last_tick is not None:
            seconds = self.last_tick()
            if seconds is not None:
                g = GaugeMetricFamily(
                    "shunter_dispatcher_last_tick_seconds", "Duration of the last dispatcher tick in this process"
                )
                g.add_metric([], seconds)
                yield g

    def _resource_seconds(self, session: Session) -> Metric:
        """CPU and GPU seconds held by attempts, by owner and queue; a running attempt's count up to this scrape."""
        c = CounterMetricFamily(
            "shunter_resource_seconds", "CPU and GPU seconds held by attempts (running ones up to now)",
            labels=["owner", "queue", "resource"],
        )  # fmt: skip
        for (owner, queue), held in sorted(usage.resource_seconds(session, now=utcnow()).items()):
            for resource, seconds in zip(("cpu", "gpu"), held, strict=True):
                labels = (owner, queue, resource)
                # An attempt's recorded end can fall a little before a scrape that already counted it up to `now`:
                # never report less than before, or Prometheus reads the dip as a counter reset.
                value = max(seconds, self._resource_high_water.get(labels, 0.0))
                self._resource_high_water[labels] = value
                c.add_metric(list(labels), value)
        return c


def _jobs_by_state(session: Session) -> Metric:
    g = GaugeMetricFamily("shunter_jobs", "Jobs by state and queue", labels=["state", "queue"])
    counts = {(JobState(s).value, q): int(n) for s, q, n in session.exec(
        select(Job.state, Job.queue, func.count()).group_by(Job.state, Job.queue)
    ).all()}  # fmt: skip
    queues = {q for _, q in counts} or {"default"}
    # Every state of every known queue, zeros included: a series that disappears reads as "no data", not 0.
    for queue in sorted(queues):
        for state in JobState:
            g.add_metric([state.value, queue], counts.get((state.value, queue), 0))
    return g


def _admissions(session: Session) -> Metric:
    c = CounterMetricFamily("shunter_admissions", "Attempts admitted to Ray (QUEUED -> STARTING)")
    admitted = (JobEvent.kind == "state", JobEvent.to_state == JobState.STARTING)
    n = session.exec(select(func.count()).select_from(JobEvent).where(*admitted)).one()
    c.add_metric([], int(n))
    return c


def _retries(session: Session) -> Metric:
    """A job going back to QUEUED from a run (the end reason) or from FAILED/CANCELLED (`retry_requested`)."""
    c = CounterMetricFamily("shunter_retries", "Jobs queued again, by reason", labels=["reason"])
    rows = session.exec(
        select(JobEvent.reason, func.count())
        .where(JobEvent.kind == "state", JobEvent.to_state == JobState.QUEUED, col(JobEvent.from_state).is_not(None))
        .group_by(JobEvent.reason)
    ).all()
    for reason, n in sorted(rows):
        c.add_metric([reason], int(n))
    return c


def _queue_wait(session: Session) -> Metric:
    """Each admission's wait: its STARTING event minus the job's latest QUEUED event before it (backoff included)."""
    queued = aliased(JobEvent)
    last_queued = (
        select(func.max(queued.at))
        .where(queued.job_id == JobEvent.job_id, queued.to_state == JobState.QUEUED, col(queued.id) < col(JobEvent.id))
        .correlate(JobEvent)
        .scalar_subquery()
    )
    rows = session.exec(
        select(JobEvent.at, last_queued).where(JobEvent.kind == "state", JobEvent.to_state == JobState.STARTING)
    ).all()
    waits = [_seconds(started, queued_at) for started, queued_at in rows if queued_at is not None]
    return histogram_family(
        "shunter_queue_wait_seconds", "Time from QUEUED to admission (STARTING)", waits, QUEUE_WAIT_BUCKETS
    )


def _seconds(later: datetime, earlier: datetime) -> float:
    return max(0.0, (later - earlier).total_seconds())


def histogram_family(name: str, doc: str, values: list[float], buckets: tuple[float, ...]) -> HistogramMetricFamily:
    """A Prometheus histogram (cumulative buckets, sum) from a list of observations."""
    ordered = sorted(values)
    cumulative = [(repr(b), bisect.bisect_right(ordered, b)) for b in buckets] + [("+Inf", len(ordered))]
    h = HistogramMetricFamily(name, doc)
    h.add_metric([], buckets=[(le, float(n)) for le, n in cumulative], sum_value=sum(ordered))
    return h


def _cluster(session: Session) -> Iterator[Metric]:
    snap = session.get(ClusterSnapshot, 1)
    if snap is None:
        return
    g = GaugeMetricFamily(
        "shunter_cluster_resources", "Ray cluster resources as last seen by a dispatcher", labels=["resource", "kind"]
    )
    for kind, values in (("total", snap.total), ("available", snap.available)):
        for resource, amount in sorted(values.items()):
            g.add_metric([resource, kind], float(amount))
    yield g
    nodes = GaugeMetricFamily("shunter_cluster_nodes", "Ray nodes alive as last seen by a dispatcher")
    nodes.add_metric([], sum(1 for n in snap.nodes if n.get("alive", True)))
    yield nodes
