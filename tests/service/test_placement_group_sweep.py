"""Placement groups that Ray keeps holding for jobs that have ended (`service.backends.ray_jobs.orphaned`) are removed
by the dispatcher, so their CPUs and GPUs are not lost to every later job for as long as the cluster lives.

Seen in a slow-tier run: a job stopped on its timeout while Ray Train's controller was restarting its worker group.
The controller registered the new group's placement group ~80 ms after the GCS had marked its job finished and
begun destroying it, so neither of Ray's clean-ups (job end, creator actor death) ever came for it; the session
head kept 1 of its 4 CPUs held, and three later tests on it waited for room that never came.

The rule is table-tested here; the real test gives a real Ray head the same state, through the GCS's own
CreatePlacementGroup call naming a job that ended and an actor that died with it, and runs one real dispatcher tick.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.backends.ray_jobs import PlacementGroupFacts, RayJobs, orphaned
from service.backends.ray_local import LocalHead
from service.config.settings import Settings
from service.dispatch.dispatcher import Dispatcher
from service.store.db import make_engine
from service.store.migrate import upgrade
from tests.conftest import wait_for


def group(pg: str, job: str = "j1", actor: str | None = "a1", detached: bool = False, removed: bool = False):
    return PlacementGroupFacts(pg_id=pg, job_id=job, actor_id=actor, detached=detached, removed=removed,
                               resources={"CPU": 1.0})  # fmt: skip


# (the group, the jobs that ended, the actors that are dead, removed?)
RULE = [
    (group("made by an actor that died with its ended job"), {"j1"}, {"a1"}, True),
    (group("made by the driver of an ended job", actor=None), {"j1"}, set(), True),
    (group("of a job still running"), set(), {"a1"}, False),
    (group("made by a live (detached) actor of an ended job"), {"j1"}, set(), False),
    (group("detached: outlives its job by design", detached=True), {"j1"}, {"a1"}, False),
    (group("already removed", removed=True), {"j1"}, {"a1"}, False),
    (group("of a running job, made by its driver", actor=None), set(), set(), False),
]


@pytest.mark.parametrize(("pg", "dead_jobs", "dead_actors", "removed"), RULE, ids=[r[0].pg_id for r in RULE])
def test_only_groups_whose_lifetime_is_over_by_rays_rule_are_removed(
    pg: PlacementGroupFacts, dead_jobs: set[str], dead_actors: set[str], removed: bool
) -> None:
    assert orphaned([pg], dead_jobs=dead_jobs, dead_actors=dead_actors) == ([pg.pg_id] if removed else [])


ENDED_JOB = """
import json, sys, ray
ray.init(address=sys.argv[1], namespace="pg-sweep", logging_level="ERROR")
@ray.remote(num_cpus=0)
class A:
    pass
dies = A.remote()
lives = A.options(lifetime="detached").remote()
ray.get([dies.__ray_ready__.remote(), lives.__ray_ready__.remote()])
print(json.dumps({"job": ray.get_runtime_context().get_job_id(), "dies": dies._actor_id.hex(),
                  "lives": lives._actor_id.hex()}))
"""


def ended_job(gcs_address: str, tmp: Path) -> dict[str, str]:
    """A real Ray job that has ended: its ids, one actor that died with it and one detached actor that lives on."""
    script = tmp / "ended_job.py"
    script.write_text(ENDED_JOB)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, str(script), gcs_address], capture_output=True, text=True, env=env,
                         timeout=120, check=True).stdout  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])


class Gcs:
    """The GCS's placement group calls, as Ray's own clients make them."""

    def __init__(self, address: str) -> None:
        from ray._private.gcs_utils import create_gcs_channel
        from ray.core.generated import gcs_service_pb2_grpc

        self.channel = create_gcs_channel(address)
        self.groups = gcs_service_pb2_grpc.PlacementGroupInfoGcsServiceStub(self.channel)
        self.actors = gcs_service_pb2_grpc.ActorInfoGcsServiceStub(self.channel)

    def create(self, *, job: str, actor: str, detached: bool = False) -> str:
        """Register a 1-CPU group as an actor of `job` registers one (Ray Train's worker group does this)."""
        from ray.core.generated import common_pb2
        from ray.core.generated import gcs_service_pb2 as pb

        pg_id = os.urandom(14) + bytes.fromhex(job)
        bundle = common_pb2.Bundle(bundle_id=common_pb2.Bundle.BundleIdentifier(placement_group_id=pg_id,
                                                                              bundle_index=0),
                                   unit_resources={"CPU": 1.0})  # fmt: skip
        spec = common_pb2.PlacementGroupSpec(placement_group_id=pg_id, strategy=common_pb2.PACK, bundles=[bundle],
                                             creator_job_id=bytes.fromhex(job), creator_actor_id=bytes.fromhex(actor),
                                             is_detached=detached)  # fmt: skip
        self.groups.CreatePlacementGroup(pb.CreatePlacementGroupRequest(placement_group_spec=spec), timeout=10)
        return pg_id.hex()

    def state(self, pg_id: str) -> str:
        from ray.core.generated import gcs_pb2
        from ray.core.generated import gcs_service_pb2 as pb

        reply = self.groups.GetPlacementGroup(pb.GetPlacementGroupRequest(placement_group_id=bytes.fromhex(pg_id)),
                                              timeout=10)  # fmt: skip
        return gcs_pb2.PlacementGroupTableData.PlacementGroupState.Name(reply.placement_group_table_data.state)

    def remove(self, pg_id: str) -> None:
        from ray.core.generated import gcs_service_pb2 as pb

        self.groups.RemovePlacementGroup(pb.RemovePlacementGroupRequest(placement_group_id=bytes.fromhex(pg_id)),
                                         timeout=10)  # fmt: skip

    def kill(self, actor: str) -> None:
        from ray.core.generated import gcs_service_pb2 as pb

        self.actors.KillActorViaGcs(pb.KillActorViaGcsRequest(actor_id=bytes.fromhex(actor), force_kill=True,
                                                              no_restart=True), timeout=10)  # fmt: skip


@pytest.fixture
def gcs(ray_head: LocalHead) -> Iterator[Gcs]:
    client = Gcs(ray_head.gcs_address)
    yield client
    client.channel.close()


def wait_created(gcs: Gcs, pg_id: str) -> None:
    wait_for(lambda: gcs.state(pg_id) == "CREATED", timeout=60, what=f"placement group {pg_id} created")


@pytest.mark.slow
def test_a_group_ray_left_held_for_an_ended_job_is_removed_by_a_dispatcher_tick(
    ray_head: LocalHead, gcs: Gcs, tmp_path: Path
) -> None:
    ended = ended_job(ray_head.gcs_address, tmp_path)
    left_held = gcs.create(job=ended["job"], actor=ended["dies"])
    kept = [gcs.create(job=ended["job"], actor=ended["lives"]),  # its creator lives on
            gcs.create(job=ended["job"], actor=ended["dies"], detached=True)]  # fmt: skip
    try:
        for pg_id in (left_held, *kept):
            wait_created(gcs, pg_id)
        ray = RayJobs(ray_head.dashboard_url, gcs_address=ray_head.gcs_address)
        # Ray holds its CPU for it (once the raylet has reported the group to the GCS).
        wait_for(lambda: f"CPU_group_{left_held}" in ray.cluster().total, timeout=30, what="its CPU held")

        settings = Settings(database_url=f"sqlite:///{tmp_path / 'shunter.db'}", data_dir=tmp_path / "data",
                            storage_uri=str(tmp_path / "ckpt"), placement_group_sweep_seconds=3600)  # fmt: skip
        engine = make_engine(settings.database_url)
        upgrade(engine)
        dispatcher = Dispatcher(engine=engine, settings=settings, ray=ray, owner="d1")
        try:
            dispatcher.tick()
            assert gcs.state(left_held) == "REMOVED"
            assert [gcs.state(pg_id) for pg_id in kept] == ["CREATED", "CREATED"]
            # Its CPU is free again (the raylet reports what it holds to the GCS a moment later).
            wait_for(lambda: f"CPU_group_{left_held}" not in ray.cluster().total, timeout=30, what="its CPU freed")
            # One sweep per period: a group left held now waits for the next one.
            again = gcs.create(job=ended["job"], actor=ended["dies"])
            kept.append(again)
            wait_created(gcs, again)
            dispatcher.tick()
            assert gcs.state(again) == "CREATED"
        finally:
            dispatcher._pool.shutdown(wait=True)
            engine.dispose()
    finally:
        for pg_id in kept:
            gcs.remove(pg_id)
        gcs.kill(ended["lives"])
