"""The Ray adapter: Ray Jobs (submit, status, stop, logs) and the cluster's resources.

Status and stop go straight to the Jobs REST API with httpx (clear status codes: a 404 is "no such job",
not a RuntimeError to parse). Submission goes through `JobSubmissionClient`, which uploads local `working_dir` /
`py_modules` packages. Submission is idempotent on the deterministic submission id: an existing Ray Job is adopted.
Driver logs are read by byte range (`service.backends.driver_logs`), never whole.
"""

from __future__ import annotations

import logging
import os
import shlex
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from service.backends import ray_autoscaler
from service.backends.driver_logs import DriverLogs
from service.core.backend import SUBMISSION_PREFIX, ClusterView, LogPiece, NodeView, RayJobInfo
from service.core.errors import InfraError
from service.core.resources import sum_of

log = logging.getLogger(__name__)
RECONNECT_MIN_SECONDS, RECONNECT_MAX_SECONDS = 0.5, 10.0


def ray_auth_headers() -> dict[str, str]:
    """Ray 2.5x turns token auth on by default; send the cluster's token when there is one."""
    token = os.environ.get("RAY_AUTH_TOKEN")
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token"))
    if not token and path.exists():
        token = path.read_text().strip()
    return {"Authorization": f"Bearer {token}"} if token else {}


@dataclass(frozen=True)
class PlacementGroupFacts:
    """What the GCS says of one placement group (ids in hex; `actor_id` None when a driver, not an actor, made it)."""

    pg_id: str
    job_id: str
    actor_id: str | None
    detached: bool
    removed: bool
    resources: dict[str, float]


def orphaned(groups: Iterable[PlacementGroupFacts], *, dead_jobs: set[str], dead_actors: set[str]) -> list[str]:
    """The placement groups whose lifetime is over by Ray's own rule, though Ray still holds them: not detached, made
    by a job that has ended, and (when an actor made it) by an actor that is dead too.

    Ray removes such a group when its job ends, or when its creator actor dies after the job ended. A group that the
    job's last actor registers while the GCS is already destroying that actor (a run stopped while Ray Train's
    controller was restarting its worker group: seen on Ray 2.60) is past both moments, and Ray then holds its
    resources for as long as the cluster lives, which leaves every later job that needs them queued for ever."""
    return [g.pg_id for g in groups
            if not g.detached and not g.removed and g.job_id in dead_jobs
            and (g.actor_id is None or g.actor_id in dead_actors)]  # fmt: skip


class RayJobs:
    """The `Backend` of a real Ray cluster, seen through its dashboard (Jobs API) and, when known, its GCS."""

    def __init__(
        self, dashboard_url: str, *, gcs_address: str | None = None, timeout: float = 10.0,
        drivers_off_head: bool = False,
    ) -> None:  # fmt: skip
        self.dashboard_url = dashboard_url.rstrip("/")
        self.gcs_address = gcs_address
        self.drivers_off_head = drivers_off_head
        self.head_node_id: str | None = None  # the live head, from the last cluster read
        headers = ray_auth_headers()
        self._http = httpx.Client(base_url=self.dashboard_url, timeout=timeout, headers=headers)
        # Driver logs by byte range, from the driver node's agent (never whole: Ray's Jobs API has no ranged read).
        self.driver_logs = DriverLogs(self._http, headers=headers, timeout=timeout)
        self._sdk: Any = None
        self._gcs: Any = None
        # Reconnecting: a GCS client outlives its cluster (after a head restart every call fails with WrongClusterID),
        # so a failed one is dropped and rebuilt, no sooner than the backoff allows.
        self._gcs_retry_at = 0.0
        self._gcs_backoff = 0.0
        self.last_problem: str | None = None  # why Ray was last unusable, for /readyz; None once it answers again

    def close(self) -> None:
        self._http.close()
        self.driver_logs.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise InfraError(f"Ray dashboard at {self.dashboard_url} unreachable: {exc}") from exc

    def ping(self) -> bool:
        return self.problem() is None

    def problem(self) -> str | None:
        """Why this cluster cannot be used now (its Jobs API or its GCS does not answer), or None."""
        try:
            status = self._http.get("/api/version", timeout=2.0).status_code
        except httpx.HTTPError as exc:
            return f"Ray dashboard at {self.dashboard_url} unreachable: {type(exc).__name__}"
        if status != 200:
            return f"Ray dashboard at {self.dashboard_url} answered {status}"
        if self.gcs_address:
            try:
                self._cluster_from_gcs()
            except InfraError as exc:
                return exc.detail
        return None

    def info(self, submission_id: str) -> RayJobInfo | None:
        """The Ray Job's status, or None if Ray has no such job."""
        r = self._request("GET", f"/api/jobs/{submission_id}")
        if r.status_code == 404:
            return None
        if r.status_code != 200:
            raise InfraError(f"Ray Jobs API answered {r.status_code} for {submission_id}: {r.text[:500]}")
        body = r.json()
        return RayJobInfo(
            submission_id=submission_id,
            status=str(body.get("status")),
            message=body.get("message"),
            error_type=body.get("error_type"),
            driver_exit_code=body.get("driver_exit_code"),
            start_time=body.get("start_time"),
            end_time=body.get("end_time"),
            driver_node_id=body.get("driver_node_id") or None,
        )

    def submit(
        self, *, submission_id: str, entrypoint: str, runtime_env: dict[str, Any], metadata: dict[str, str]
    ) -> bool:
        """Submit unless Ray already has this submission id. True if submitted now, False if adopted.

        Straight to Ray, with no look first: Ray refuses a submission id it already has, and only then is it looked
        up (one round trip to the dashboard less on every attempt's start)."""
        placement: dict[str, Any] = {}
        if self.drivers_off_head:
            # Ray places a driver on the head unless told otherwise; a node-id selector is the one that needs no
            # labels set up on the cluster. Read now, not remembered: after a head restart the head is a new node.
            placement["entrypoint_label_selector"] = {"ray.io/node-id": f"!{self._read_head_node_id()}"}
        try:
            self._client().submit_job(
                entrypoint=entrypoint, submission_id=submission_id, runtime_env=runtime_env, metadata=metadata,
                **placement,
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - Ray raises RuntimeError/ConnectionError/ValueError here
            # A racing submitter (or our own earlier try whose answer was lost) got there first: adopt it.
            if self.info(submission_id) is not None:
                return False
            raise InfraError(f"Ray refused submission {submission_id}: {exc}") from exc
        return True

    def stop(self, submission_id: str) -> bool:
        r = self._request("POST", f"/api/jobs/{submission_id}/stop")
        if r.status_code == 404:
            return False
        if r.status_code != 200:
            raise InfraError(f"Ray could not stop {submission_id}: {r.status_code} {r.text[:300]}")
        return bool(r.json().get("stopped"))

    def log_range(self, submission_id: str, start: int, length: int) -> LogPiece | None:
        return self.driver_logs.read(submission_id, start, length)

    def log_stream(self, submission_id: str, start: int, end: int | None) -> Iterator[bytes] | None:
        return self.driver_logs.stream(submission_id, start, end)

    def dump_stacks(self, submission_id: str, *, dump_id: str) -> str:
        """Submit `python -m workers.stacks` as a Ray Job of its own: the control plane holds no Ray driver, and the
        stacks must be asked for on the train workers' nodes. It runs in the attempt's own runtime_env (as Ray
        recorded it: its working_dir already uploaded), so `workers` imports there as it does in the attempt, and on
        no CPU, so a cluster the job fills still runs it."""
        r = self._request("GET", f"/api/jobs/{submission_id}")
        if r.status_code == 404:
            return "Ray no longer knows the attempt: no stacks to dump"
        if r.status_code != 200:
            raise InfraError(f"Ray Jobs API answered {r.status_code} for {submission_id}: {r.text[:500]}")
        body = r.json()
        ray_job_id, job_id = body.get("job_id"), (body.get("metadata") or {}).get("shunter_job_id")
        if not ray_job_id or not job_id:
            return "the attempt's Ray driver has not started: no stacks to dump"
        if self.info(dump_id) is not None:
            return f"Ray Job {dump_id} dumps the stacks (asked for before)"
        entrypoint = f"python -m workers.stacks --ray-job-id {shlex.quote(ray_job_id)} --job-id {shlex.quote(job_id)}"
        metadata = {"shunter_job_id": job_id, "shunter_stacks_of": submission_id}
        try:
            self._client().submit_job(entrypoint=entrypoint, submission_id=dump_id, metadata=metadata,
                                      runtime_env=body.get("runtime_env") or {}, entrypoint_num_cpus=0)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - Ray raises RuntimeError/ConnectionError/ValueError here
            if self.info(dump_id) is None:
                raise InfraError(f"Ray refused the stack dump {dump_id}: {exc}") from exc
        return f"Ray Job {dump_id} dumps the stacks"

    def list_submission_ids(self, prefix: str = SUBMISSION_PREFIX) -> list[str]:
        r = self._request("GET", "/api/jobs/")
        if r.status_code != 200:
            raise InfraError(f"Ray Jobs API list answered {r.status_code}")
        return [j["submission_id"] for j in r.json() if (j.get("submission_id") or "").startswith(prefix)]

    def cluster(self) -> ClusterView:
        """Per-node total and available resources (from the GCS when its address is known)."""
        if self.gcs_address:
            return self._cluster_from_gcs()
        return self._cluster_from_dashboard()

    def _read_head_node_id(self) -> str:
        self.cluster()
        head = self.head_node_id
        if head is None:
            raise InfraError("Ray shows no live head node: cannot place a driver off it")
        return head

    def warm(self) -> None:
        """Make the Ray Jobs SDK client ahead of the first submission (importing it and Ray's version check take a
        few hundred milliseconds, which the first job's start would otherwise wait for). Never raises."""
        try:
            self._client()
        except Exception:  # noqa: BLE001 - Ray not up yet: the first submission makes it
            log.debug("Ray Jobs client not made ahead", exc_info=True)

    def _client(self) -> Any:
        if self._sdk is None:
            from ray.job_submission import JobSubmissionClient

            self._sdk = JobSubmissionClient(self.dashboard_url)
        return self._sdk

    def request_resources(self, bundles: list[dict[str, float]]) -> None:
        """Ask Ray's autoscaler for room for `bundles`, replacing the last request ([]: withdrawn)."""
        if not self.gcs_address:
            raise InfraError("no GCS address is known: Ray's autoscaler cannot be asked for room")
        if self._gcs is None:
            self._cluster_from_gcs()  # the client, made (with its backoff) as the tick's cluster reads make it
        ray_autoscaler.request_resources(self._gcs, self.gcs_address, bundles)

    def _cluster_from_gcs(self) -> ClusterView:
        from ray._raylet import GcsClient  # type: ignore[attr-defined]  # Ray's _raylet.pyi leaves it out
        from ray.core.generated.gcs_pb2 import GcsNodeInfo

        now = time.monotonic()
        if self._gcs is None and now < self._gcs_retry_at:
            raise InfraError(f"reconnecting to Ray GCS at {self.gcs_address} in {self._gcs_retry_at - now:.1f}s "
                             f"({self.last_problem})")  # fmt: skip
        try:
            if self._gcs is None:
                self._gcs = GcsClient(address=self.gcs_address)
            usage = self._gcs.get_all_resource_usage(timeout=5)
            node_table = self._gcs.get_all_node_info(timeout=5)
        except Exception as exc:  # noqa: BLE001 - the GCS client raises its own RpcError types
            # Gone, or a new cluster at the same address (WrongClusterID): rebuild every client on a later call.
            self._gcs, self._sdk, self.head_node_id = None, None, None
            self._gcs_backoff = min(max(self._gcs_backoff * 2, RECONNECT_MIN_SECONDS), RECONNECT_MAX_SECONDS)
            self._gcs_retry_at = time.monotonic() + self._gcs_backoff
            self.last_problem = (
                f"Ray GCS at {self.gcs_address}: {str(exc).splitlines()[0][:300] if str(exc) else exc!r}"
            )
            raise InfraError(self.last_problem) from exc
        self._gcs_backoff, self.last_problem = 0.0, None
        nodes = []
        for item in usage.resource_usage_data.batch:
            nodes.append(
                NodeView(
                    node_id=item.node_id.hex(),
                    address=item.node_manager_address,
                    alive=not item.is_draining,
                    total=dict(item.resources_total),
                    available=dict(item.resources_available),
                )
            )
        dead, head = {}, None
        for node_id, node in node_table.items():
            if node.state == GcsNodeInfo.GcsNodeState.DEAD:
                dead[node_id.hex()] = bool(node.is_head_node)
            elif node.is_head_node:
                head = node_id.hex()
        self.head_node_id = head  # one assignment: readers in other threads never see it half-built
        return ClusterView(nodes=nodes, dead_nodes=dead)

    def free_orphaned_placement_groups(self) -> list[PlacementGroupFacts]:
        """Remove the placement groups that Ray should have removed and did not (`orphaned`); return them. Needs the GCS
        (an address given); without it, or when it does not answer, nothing is done (the next sweep tries again)."""
        if not self.gcs_address:
            return []
        from ray._private.gcs_utils import create_gcs_channel
        from ray._raylet import GcsClient  # type: ignore[attr-defined]  # Ray's _raylet.pyi leaves it out
        from ray.core.generated import gcs_pb2
        from ray.core.generated import gcs_service_pb2 as pb
        from ray.core.generated import gcs_service_pb2_grpc as rpc

        channel = create_gcs_channel(self.gcs_address)  # a new one each time: a head restart is a new cluster
        try:
            groups_rpc = rpc.PlacementGroupInfoGcsServiceStub(channel)
            table = groups_rpc.GetAllPlacementGroup(pb.GetAllPlacementGroupRequest(), timeout=5)
            removed = gcs_pb2.PlacementGroupTableData.REMOVED
            groups = {
                g.placement_group_id.hex(): PlacementGroupFacts(
                    pg_id=g.placement_group_id.hex(), job_id=g.creator_job_id.hex(),
                    actor_id=None if g.creator_actor_id.strip(b"\xff") == b"" else g.creator_actor_id.hex(),
                    detached=g.is_detached, removed=g.state == removed,
                    resources=sum_of(dict(b.unit_resources) for b in g.bundles),
                )
                for g in table.placement_group_table_data
            }  # fmt: skip
            live = [g for g in groups.values() if not g.detached and not g.removed]
            if not live:
                return []
            gcs = self._gcs if self._gcs is not None else GcsClient(address=self.gcs_address)
            jobs = gcs.get_all_job_info(skip_submission_job_info_field=True, skip_is_running_tasks_field=True,
                                        timeout=5)  # fmt: skip
            dead_jobs = {job_id.hex() for job_id, job in jobs.items() if job.is_dead}
            actors_rpc = rpc.ActorInfoGcsServiceStub(channel)
            dead_actors = set()
            for actor_id in {g.actor_id for g in live if g.job_id in dead_jobs and g.actor_id is not None}:
                reply = actors_rpc.GetActorInfo(pb.GetActorInfoRequest(actor_id=bytes.fromhex(actor_id)), timeout=5)
                actor = reply.actor_table_data if reply.HasField("actor_table_data") else None
                if actor is None or actor.state == gcs_pb2.ActorTableData.DEAD:
                    dead_actors.add(actor_id)
            freed = []
            for pg_id in orphaned(live, dead_jobs=dead_jobs, dead_actors=dead_actors):
                groups_rpc.RemovePlacementGroup(pb.RemovePlacementGroupRequest(placement_group_id=bytes.fromhex(pg_id)),
                                                timeout=5)  # fmt: skip
                group = groups[pg_id]
                freed.append(group)
                log.warning("removed placement group %s, which Ray still held for ended Ray job %s (made by actor %s, "
                            "dead): %s", pg_id, group.job_id, group.actor_id, group.resources)  # fmt: skip
            return freed
        finally:
            channel.close()

    def _cluster_from_dashboard(self) -> ClusterView:
        r = self._request("GET", "/nodes", params={"view": "summary"})
        if r.status_code != 200:
            raise InfraError(f"Ray dashboard /nodes answered {r.status_code}")
        nodes, dead, head = [], {}, None
        for summary in r.json()["data"]["summary"]:
            raylet = summary.get("raylet", {})
            if raylet.get("state") == "DEAD":
                dead[raylet.get("nodeId", "")] = bool(raylet.get("isHeadNode"))
            elif raylet.get("isHeadNode"):
                head = raylet.get("nodeId")
            total = {k: float(v) for k, v in raylet.get("resourcesTotal", {}).items()}
            nodes.append(
                NodeView(
                    node_id=raylet.get("nodeId", ""),
                    address=raylet.get("nodeManagerAddress", ""),
                    alive=raylet.get("state") == "ALIVE",
                    total=total,
                    # The dashboard gives no per-node availability; cluster-wide usage is spread below.
                    available=dict(total),
                )
            )
        status = self._request("GET", "/api/cluster_status")
        if status.status_code == 200 and nodes:
            usage = status.json()["data"]["clusterStatus"]["loadMetricsReport"]["usage"]
            for key, (used, _total) in usage.items():
                remaining = float(used)
                for node in nodes:
                    if key in node.available:
                        take = min(remaining, node.available[key])
                        node.available[key] -= take
                        remaining -= take
        self.head_node_id = head
        return ClusterView(nodes=nodes, dead_nodes=dead)
