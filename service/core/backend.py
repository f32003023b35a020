"""What the dispatcher needs of a cluster, as a typed Protocol: `RayJobs` (service/backends/ray_jobs.py) implements it
against Ray, `NoopJobs` (service/backends/noop.py) for queue stress tests and fault injection. The views it returns and
the deterministic Ray submission id live here too, so every module names them the same way.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from service.core import resources

RAY_TERMINAL = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})
SUBMISSION_PREFIX = "shunter-"


def submission_id(job_id: str, attempt: int) -> str:
    """One Ray Job per attempt, named so a restarted dispatcher finds (adopts) it instead of submitting it twice."""
    return f"{SUBMISSION_PREFIX}{job_id}-{attempt}"


@dataclass(frozen=True)
class RayJobInfo:
    submission_id: str
    status: str  # PENDING | RUNNING | STOPPED | SUCCEEDED | FAILED
    message: str | None = None
    error_type: str | None = None
    driver_exit_code: int | None = None
    start_time: int | None = None
    end_time: int | None = None
    driver_node_id: str | None = None  # the Ray node its driver (JobSupervisor) runs on, once placed

    @property
    def is_terminal(self) -> bool:
        return self.status in RAY_TERMINAL


@dataclass(frozen=True)
class LogPiece:
    """Bytes of a Ray Job's driver log from byte `start` (fewer than asked at its end), and the log's size when they
    were read."""

    start: int
    data: bytes
    size: int


def piece_of(text: str | None, start: int, length: int) -> LogPiece | None:
    """A range of a log a stand-in backend holds whole as text (its logs are a line or two)."""
    if text is None:
        return None
    data = text.encode("utf-8", errors="replace")
    return LogPiece(start, data[start : start + length], len(data))


def chunks_of(text: str | None, start: int, end: int | None) -> Iterator[bytes] | None:
    piece = piece_of(text, start, (1 << 62) if end is None else max(end - start, 0))
    return None if piece is None else iter([piece.data] if piece.data else [])


def log_tail(backend: Backend, submission_id: str, length: int) -> bytes | None:
    """The last `length` bytes (at most) of a job's driver log; None if the cluster has no such job."""
    piece = backend.log_range(submission_id, 0, length)
    if piece is not None and piece.size > length:
        piece = backend.log_range(submission_id, piece.size - length, length)
    return None if piece is None else piece.data


@dataclass
class NodeView:
    node_id: str
    address: str
    alive: bool
    total: dict[str, float] = field(default_factory=dict)
    available: dict[str, float] = field(default_factory=dict)


@dataclass
class ClusterView:
    nodes: list[NodeView]
    # Ray nodes known dead (id -> was it a head). A Ray Job whose driver ran on one is gone, even while Ray still
    # reports it RUNNING: with GCS fault tolerance the job table outlives a restarted head, but not the drivers on it.
    dead_nodes: dict[str, bool] = field(default_factory=dict)

    @property
    def total(self) -> dict[str, float]:
        return resources.sum_of(n.total for n in self.nodes if n.alive)

    @property
    def available(self) -> dict[str, float]:
        return resources.sum_of(n.available for n in self.nodes if n.alive)


@runtime_checkable
class Backend(Protocol):
    """A cluster that runs one job per submission id. Errors it cannot answer through are `InfraError`."""

    dashboard_url: str
    gcs_address: str | None

    def close(self) -> None: ...

    def ping(self) -> bool: ...

    def problem(self) -> str | None:
        """Why the cluster cannot be used now (unreachable, reconnecting after a restart), or None."""
        ...

    def info(self, submission_id: str) -> RayJobInfo | None:
        """The job's status, or None if the cluster has no job of that id."""
        ...

    def submit(
        self, *, submission_id: str, entrypoint: str, runtime_env: dict[str, Any], metadata: dict[str, str]
    ) -> bool:
        """Submit unless the id exists: True if submitted now, False if an existing job was adopted."""
        ...

    def stop(self, submission_id: str) -> bool: ...

    def log_range(self, submission_id: str, start: int, length: int) -> LogPiece | None:
        """At most `length` (>= 1) bytes of the job's driver log from byte `start`, and the log's size now; None if the
        cluster has no job of that id. Never the whole log: what it holds is `length` bytes."""
        ...

    def log_stream(self, submission_id: str, start: int, end: int | None) -> Iterator[bytes] | None:
        """Bytes [start, end) of the job's driver log (to its end as it is now, for None), a chunk at a time as they are
        read (errors while reading are `InfraError`); None if the cluster has no job of that id."""
        ...

    def dump_stacks(self, submission_id: str, *, dump_id: str) -> str:
        """Have every rank of attempt `submission_id` print its Python stack into the attempt's log, through a job
        of its own named `dump_id` (`info(dump_id)` tells when it ended; asking again adopts it); what was done, in
        words, for the job's events."""
        ...

    def list_submission_ids(self, prefix: str = SUBMISSION_PREFIX) -> list[str]: ...

    def cluster(self) -> ClusterView: ...


def checked(cluster: ClusterView) -> ClusterView:
    """Ray's answer as plain finite floats per node; ValueError/TypeError if it is not of that shape."""
    nodes = []
    for node in cluster.nodes:
        total = {str(k): float(v) for k, v in dict(node.total).items()}
        available = {str(k): float(v) for k, v in dict(node.available).items()}
        if not all(math.isfinite(v) for v in (*total.values(), *available.values())):
            raise ValueError(f"node {node.node_id}: resources that are not finite numbers")
        nodes.append(NodeView(str(node.node_id), str(node.address), bool(node.alive), total, available))
    return ClusterView(nodes=nodes, dead_nodes={str(k): bool(v) for k, v in dict(cluster.dead_nodes).items()})
