"""Jobs in the states the pages show, made the way the service makes them: submitted over the real API, admitted by
the real admission pass, progress reported through the attempt API a job's train loop uses, state changed by
`service.lifecycle.state.transition` as the dispatcher does. Shared by the browser tests and the screenshot command."""

from __future__ import annotations

from typing import Any

import httpx
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from service.config.settings import Settings
from service.core.backend import ClusterView, NodeView
from service.dispatch import admission
from service.lifecycle.state import transition
from service.spec.job import JobSpec
from service.store.models import Attempt, ClusterSnapshot, EndReason, Job, JobState, utcnow
from tests.live_api import LiveApi

NODES = [("a" * 56, "10.0.0.11"), ("b" * 56, "10.0.0.12")]


def spec(name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "entrypoint": {"callable": "examples.mlp:train_loop"}, "config": {"total_steps": 30},
            "resources": {"num_workers": 2, "resources_per_worker": {"CPU": 1}}} | extra  # fmt: skip


def submit(api: LiveApi, body: dict[str, Any], token: str | None = None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = httpx.post(f"{api.url}/v1/jobs", json=body, headers=headers, timeout=30)
    assert response.status_code == 201, response.text
    return response.json()  # type: ignore[no-any-return]


def cluster_view(cpus_per_node: float = 4.0) -> ClusterView:
    return ClusterView([NodeView(node, address, True, {"CPU": cpus_per_node}, {"CPU": cpus_per_node})
                        for node, address in NODES])  # fmt: skip


def admit(engine: Engine, settings: Settings, cpus_per_node: float = 4.0) -> list[str]:
    """One admission pass over a cluster of two nodes: the jobs it started (STARTING, attempt rows made)."""
    spec_of = lambda j: (JobSpec.model_validate(j.spec), None)  # noqa: E731
    resources_of = lambda j: JobSpec.model_validate(j.spec).resources.total(j.world_size)  # noqa: E731
    started, _ = admission.admit(engine, settings, cluster_view(cpus_per_node), owner="ui-test", now=utcnow(),
                                 spec_of=spec_of, resources_of=resources_of)  # fmt: skip
    return [j.id for j in started]


def snapshot(engine: Engine, *, dashboard_url: str = "http://127.0.0.1:8265", free: float = 1.0) -> None:
    """The dispatcher's record of the cluster, as /v1/cluster reads it."""
    nodes = [{"node_id": n, "address": a, "alive": True, "total": {"CPU": 4.0, "memory": 16 * 2**30},
              "available": {"CPU": free, "memory": 8 * 2**30}} for n, a in NODES]  # fmt: skip
    with Session(engine) as session:
        row = session.get(ClusterSnapshot, 1) or ClusterSnapshot(id=1)
        row.dashboard_url, row.nodes, row.taken_at = dashboard_url, nodes, utcnow()
        row.total = {"CPU": 8.0, "memory": 32 * 2**30}
        row.available = {"CPU": 2 * free, "memory": 16 * 2**30}
        session.add(row)
        session.commit()


def move(engine: Engine, job_id: str, to: JobState, reason: str, message: str | None = None, **values: Any) -> None:
    with Session(engine) as session:
        job = session.get(Job, job_id)
        assert job is not None
        transition(session, job, to=to, reason=reason, message=message, values=values or None)
        session.commit()


def end_attempt(engine: Engine, job_id: str, reason: EndReason, message: str) -> None:
    """The current attempt ends as the dispatcher records it (its row), before the job's own transition."""
    with Session(engine) as session:
        job = session.get(Job, job_id)
        assert job is not None
        row = session.exec(select(Attempt).where(Attempt.job_id == job_id, Attempt.number == job.attempt)).one()
        row.ended_at, row.end_reason, row.message = utcnow(), reason, message
        session.add(row)
        session.commit()


def train(api: LiveApi, job_id: str, attempt: int, losses: list[tuple[int, float]], *, checkpoint_every: int = 10,
          storage: str = "/shared/ckpt") -> None:  # fmt: skip
    """Attempt `attempt` starts and reports (step, loss) through the attempt API, with a checkpoint every N steps;
    the job goes RUNNING as the dispatcher moves it once its ranks have started."""
    reporter = api.attempt_api(job_id, attempt)
    assert reporter.started()
    move(api.engine, job_id, JobState.RUNNING, "first_report")
    for step, loss in losses:
        uri = f"{storage}/{job_id}/checkpoint_{step:06d}" if step % checkpoint_every == 0 else None
        assert reporter.report({"loss": loss, "throughput": 900.0 + step}, step=step, checkpoint_uri=uri)
