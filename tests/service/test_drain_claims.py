"""A `node_draining` end is claimed from the job's side; the dispatcher counts it as a drain (not against
`max_attempts`) only when Ray bears it out: a node the claim names went draining or dead after the attempt started."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from service.core.backend import ClusterView, NodeView
from service.dispatch.nodes import NodeHistory

T0 = datetime(2026, 12, 2, 12, tzinfo=timezone.utc)
A, B, C = "a" * 56, "b" * 56, "c" * 56


def view(*, draining: tuple[str, ...] = (), dead: tuple[str, ...] = (), alive: tuple[str, ...] = ()) -> ClusterView:
    nodes = [NodeView(n, "10.0.0.1", False, {"CPU": 1}, {"CPU": 1}) for n in draining]
    nodes += [NodeView(n, "10.0.0.2", True, {"CPU": 1}, {"CPU": 1}) for n in alive]
    return ClusterView(nodes=nodes, dead_nodes=dict.fromkeys(dead, False))


@pytest.mark.parametrize(
    ("seen", "claim", "confirmed"),
    [
        pytest.param([(10, view(draining=(A,)))], f"node draining: {A} (ranks [1])", True, id="named-node-drains"),
        pytest.param([(10, view(dead=(A,)))], f"Draining nodes: {A}.", True, id="named-node-died-since"),
        pytest.param([(10, view(draining=(B,)))], f"node draining: {A}", False, id="another-node-drains"),
        pytest.param([(-10, view(dead=(A,)))], f"node draining: {A}", False, id="named-node-died-before-the-start"),
        pytest.param([(10, view(alive=(A,)))], f"node draining: {A}", False, id="named-node-is-fine"),
        pytest.param([(10, view(draining=(A,)))], "node draining: a node", False, id="no-node-named"),
        pytest.param([(-10, view(dead=(C,))), (10, view(draining=(A,), dead=(C,)))], f"{C} and {A}", True,
                     id="one-of-several-named"),
    ],
)  # fmt: skip
def test_a_drain_claim_is_borne_out_by_what_ray_showed(
    seen: list[tuple[int, ClusterView]], claim: str, confirmed: bool
) -> None:
    history = NodeHistory()
    for offset, cluster in seen:
        history.observe(cluster, T0 + timedelta(seconds=offset))
    assert history.confirms(T0, claim) is confirmed


def test_the_first_sighting_counts_not_the_latest() -> None:
    """A node dead since before the attempt stays dead in every later view: it never bears out a later claim."""
    history = NodeHistory()
    for offset in (-60, 0, 60):
        history.observe(view(dead=(A,)), T0 + timedelta(seconds=offset))
    assert not history.confirms(T0, A)
    assert history.confirms(T0.replace(tzinfo=None) - timedelta(seconds=120), A)  # a naive start reads as UTC


def test_earlier_node_losses_are_counted_from_the_attempts(db: object) -> None:
    """What bounds the free retries (SHUNTER_MAX_FREE_NODE_LOSSES): earlier attempts that drained or lost a node."""
    from sqlmodel import Session

    from service.lifecycle.reports import node_losses
    from service.store.models import Attempt, EndReason, Job

    with Session(db) as session:  # type: ignore[arg-type]
        job = Job(name="j", spec={}, attempt=4)
        session.add(job)
        session.flush()
        ends = [EndReason.NODE_DRAINING, EndReason.WORKER_LOST, EndReason.NODE_LOST, None]
        for number, end in enumerate(ends, start=1):
            session.add(Attempt(job_id=job.id, number=number, submission_id=f"s-{job.id}-{number}", end_reason=end))
        session.commit()
        current = max(a.id for a in session.query(Attempt).all() if a.job_id == job.id)
        job_id = job.id
    assert node_losses(db, job_id, current, EndReason.NODE_LOST) == 2  # type: ignore[arg-type]
    assert node_losses(db, job_id, current, EndReason.NODE_DRAINING) == 2  # type: ignore[arg-type]
    assert node_losses(db, job_id, current, EndReason.WORKER_LOST) == 0  # type: ignore[arg-type]  # not asked
