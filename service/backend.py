"""What the dispatcher needs of a cluster, as a typed Protocol: `RayJobs` (service/ray_jobs.py) implements it against
Ray, `NoopJobs` (service/noop_backend.py) for queue stress tests and fault injection. The views it returns and the
deterministic Ray submission id live here too, so every module names them the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from service import resources

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

    def logs(self, submission_id: str) -> str | None: ...

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
