"""Node faults in the database: written with an attempt's end (`record`), read for admission (`excluded`) through
the pure rules of `service.policy.exclusion`, and cleared by an admin (`clear`)."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from sqlalchemy import update
from sqlmodel import Session, col, select

from service.policy.exclusion import Excluded, Fault, Rules, for_everyone, for_job, named_nodes
from service.store.models import EndReason, Job, NodeFault, utcnow


def record(
    session: Session, *, job_id: str, attempt: int, reason: EndReason, message: str, address: str | None = None
) -> list[str]:
    """Write a fault for each node the attempt's end names; returns their ids. In the caller's transaction."""
    nodes = named_nodes(reason.value, message)
    for node in nodes:
        session.add(NodeFault(node_id=node, job_id=job_id, attempt=attempt, reason=reason.value, address=address,
                              message=(message or "")[:2000]))  # fmt: skip
    return nodes


def _faults(rows: Iterable[tuple[NodeFault, str]]) -> list[Fault]:
    return [Fault(r.node_id, r.job_id, r.reason, r.at, r.address, owner) for r, owner in rows]


def _rows(session: Session, *where: Any) -> list[tuple[NodeFault, str]]:
    query = select(NodeFault, Job.owner).join(Job, col(Job.id) == col(NodeFault.job_id)).where(*where)
    return list(session.exec(query).all())


def excluded(
    session: Session, job_ids: list[str], rules: Rules, *, now: datetime | None = None
) -> tuple[dict[str, Excluded], dict[str, dict[str, str]]]:
    """(nodes out of everyone's admissions, and per job of `job_ids` the nodes out of its retries)."""
    now = now or utcnow()
    live = col(NodeFault.cleared_at).is_(None)
    recent = _rows(session, live, col(NodeFault.at) > now - rules.cooldown)
    everyone = for_everyone(_faults(recent), rules, now=now)
    per_job: dict[str, dict[str, str]] = {}
    if job_ids:
        rows = _rows(session, live, col(NodeFault.job_id).in_(job_ids))
        mine: dict[str, list[Fault]] = {}
        for f in _faults(rows):
            mine.setdefault(f.job_id, []).append(f)
        per_job = {job: nodes for job, faults in mine.items() if (nodes := for_job(faults, rules))}
    return everyone, per_job


def clear(session: Session, node_id: str, *, actor: str, now: datetime | None = None) -> int:
    """Let a node back in, for every job: its faults so far no longer count. Returns how many were cleared."""
    result = session.execute(
        update(NodeFault)
        .where(col(NodeFault.node_id) == node_id, col(NodeFault.cleared_at).is_(None))
        .values(cleared_at=now or utcnow(), cleared_by=actor[:128])
    )
    return int(result.rowcount or 0)  # type: ignore[attr-defined]  # an UPDATE's result is a CursorResult; Session.execute says Result
