"""/v1/cluster: Ray nodes and resources from the dispatcher's snapshot, and shunter's jobs running on them."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from api.deps import CallerDep, SessionDep, SettingsDep
from api.routes.jobs import to_public
from api.schemas import ERROR_RESPONSES, ClearedNode, ClusterJob, ClusterPublic, ExcludedNode, NodePublic
from service.config import policies
from service.core.errors import Forbidden, NotFound
from service.lifecycle import jobs, node_faults
from service.spec.job import JobSpec
from service.store.db import begin_write
from service.store.models import utcnow

router = APIRouter(prefix="/v1/cluster", tags=["cluster"], responses=ERROR_RESPONSES)


@router.get("", response_model=ClusterPublic)
def cluster(session: SessionDep, caller: CallerDep, settings: SettingsDep) -> ClusterPublic:
    """Nodes, total and free resources, the Ray dashboard URL, and the running jobs the caller may see."""
    snap = jobs.cluster_snapshot(session)
    running = []
    for job in jobs.active_jobs(session, caller=caller):
        public = to_public(job, session)
        running.append(
            ClusterJob(
                **public.model_dump(include={"id", "name", "owner", "queue", "state", "attempt", "started_at"}),
                resources=JobSpec.model_validate(job.spec).resources.total(),
                ray_submission_id=public.ray_submission_id,
                ray_dashboard_url=public.ray_dashboard_url,
            )
        )
    everyone, _ = node_faults.excluded(session, [], policies.exclusion_rules(settings))
    # Which jobs failed on a node: only the caller's own are named to a non-admin (another owner's job ids told
    # anyone what ran where: issue 35); `why` still counts them all.
    named = jobs.visible_ids(session, {j for e in everyone.values() for j in e.jobs}, caller=caller)
    excluded = [ExcludedNode(node_id=e.node_id, address=e.address, why=e.why, jobs=[j for j in e.jobs if j in named],
                             until=e.until) for e in everyone.values()]  # fmt: skip
    if snap is None:
        return ClusterPublic(nodes=[], total={}, available={}, jobs=running, excluded_nodes=excluded)
    return ClusterPublic(
        dashboard_url=snap.dashboard_url,
        taken_at=snap.taken_at,
        age_seconds=round((utcnow() - snap.taken_at).total_seconds(), 3),
        nodes=[NodePublic.model_validate(n) for n in snap.nodes],
        total=snap.total,
        available=snap.available,
        jobs=running,
        excluded_nodes=excluded,
        scale_request=snap.scale_request,
    )


NodeId = Annotated[str, Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]


@router.delete("/excluded-nodes/{node_id}", response_model=ClearedNode)
def clear_node(node_id: NodeId, session: SessionDep, caller: CallerDep) -> ClearedNode:
    """Let a node back in for every job (admins only): the failures recorded on it so far no longer count, for the
    cluster-wide cool-down and for each job's own retries alike. 404 when nothing kept it out."""
    if not caller.admin:
        raise Forbidden("only an admin may let an excluded node back in")
    begin_write(session)
    cleared = node_faults.clear(session, node_id, actor=caller.owner)
    if not cleared:
        session.rollback()
        raise NotFound(f"node {node_id} has no failures recorded against it")
    session.commit()
    return ClearedNode(node_id=node_id, cleared_faults=cleared)
