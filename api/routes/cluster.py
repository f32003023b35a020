"""/v1/cluster: Ray nodes and resources from the dispatcher's snapshot, and shunter's jobs running on them."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import CallerDep, SessionDep
from api.routes.jobs import to_public
from api.schemas import ERROR_RESPONSES, ClusterJob, ClusterPublic, NodePublic
from service import jobs
from service.models import utcnow
from service.spec import JobSpec

router = APIRouter(prefix="/v1/cluster", tags=["cluster"], responses=ERROR_RESPONSES)


@router.get("", response_model=ClusterPublic)
def cluster(session: SessionDep, caller: CallerDep) -> ClusterPublic:
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
    if snap is None:
        return ClusterPublic(nodes=[], total={}, available={}, jobs=running)
    return ClusterPublic(
        dashboard_url=snap.dashboard_url,
        taken_at=snap.taken_at,
        age_seconds=round((utcnow() - snap.taken_at).total_seconds(), 3),
        nodes=[NodePublic.model_validate(n) for n in snap.nodes],
        total=snap.total,
        available=snap.available,
        jobs=running,
    )
