"""Fair share on a real local Ray: alice queues two 2-worker jobs, then bob one; bob's runs second, not
third as first come, first served would run it. (First come, first served within one owner is the fair-share
table's case "fifo", tests/service/test_fair_share.py.) The jobs cannot fit beside each other: bob's waits with its
reason, and they run one after another, never two worker groups at once (the suite's real-Ray proof of it since
issue 34, which folded tests/service/test_scheduling_ray.py's two-job case in here).

The session's Ray head has 4 logical CPUs, so each job asks them all, on one worker (fair share is about whose job
runs next, not how many workers it has; a worker process costs ~3 CPU-s to start, issue 34): the jobs run one at a
time, as jobs of a whole machine would.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from api.client import Client
from service.backends.ray_local import free_port
from service.policy.scheduler import WAITING_FOR_ROOM
from tests.conftest import RAY_TEST_CPUS, wait_for
from tests.service.conftest import Service, service_env, stop_leftover_ray_jobs
from tests.service.test_e2e_serve import mlp_spec

pytestmark = pytest.mark.slow
TOKENS = {"tok-alice": {"owner": "alice", "team": "vision"}, "tok-bob": {"owner": "bob", "team": "nlp"}}


@pytest.fixture
def svc(ray_head, tmp_path: Path) -> Iterator[Service]:
    service = Service(data_dir=tmp_path, port=free_port(), env={})
    service.env = service_env(tmp_path, ray_head, service.port, SHUNTER_API_TOKENS=json.dumps(TOKENS))
    service.start()
    yield service
    service.stop()
    stop_leftover_ray_jobs(ray_head)


def test_bobs_one_job_runs_second_behind_alices_running_one_not_third(svc: Service) -> None:
    spec = mlp_spec(total_steps=10, checkpoint_every=10)
    spec["resources"] = {"num_workers": 1, "resources_per_worker": {"CPU": RAY_TEST_CPUS}}
    with Client(svc.url, token="tok-alice") as alice, Client(svc.url, token="tok-bob") as bob:
        first = alice.submit(spec | {"name": "alice-0"}).id
        wait_for(lambda: alice.get(first).state in ("STARTING", "RUNNING"), timeout=60, what="alice's first admitted")
        rest = [alice.submit(spec | {"name": f"alice-{i}"}).id for i in range(1, 2)]
        mine = bob.submit(spec | {"name": "bob-0"}).id
        queued = bob.get(mine)
        assert queued.state == "QUEUED" and queued.position is not None
        wait_for(lambda: WAITING_FOR_ROOM in (bob.get(mine).state_reason or ""), timeout=30,
                 what="bob's job to wait with its reason")  # fmt: skip
        assert bob.get(mine).state == "QUEUED"
        assert queued.position.overall == 1, queued  # already next: alice is using the cluster, bob is not
        for job_id in [first, *rest]:
            assert alice.wait(job_id, timeout=300).state == "SUCCEEDED"
        assert bob.wait(mine, timeout=300).state == "SUCCEEDED"
        starts = {}
        for client, job_id in [(alice, first), *((alice, j) for j in rest), (bob, mine)]:
            starts[job_id] = next(e.at for e in client.events(job_id) if e.to_state == "STARTING")
        order = sorted(starts, key=starts.__getitem__)
        assert order.index(mine) == 1, f"bob's job started {order.index(mine) + 1}th"
        assert order[0] == first and [j for j in order if j != mine] == [first, *rest]  # FIFO within alice's
        # Never two worker groups at once: each job is admitted only once the one before it has ended its training
        # and Ray has released its workers (which can be a moment before that one's driver exits and it SUCCEEDED).
        clients = {first: alice, **{j: alice for j in rest}, mine: bob}
        for before, after in zip(order, order[1:], strict=False):
            last_step = max(m.at for m in clients[before].metrics(before, name="loss"))
            assert starts[after] >= last_step, (before, after)
        # Each sees their own fair-share line only (another owner's usage is theirs): alice's usage is above bob's.
        share = {}
        for token in ("tok-alice", "tok-bob"):
            listed = httpx.get(f"{svc.url}/v1/queues", headers={"Authorization": f"Bearer {token}"}, timeout=10)
            owners = [o for q in listed.json() for o in q["owners"]]
            assert {o["owner"] for o in owners} == {TOKENS[token]["owner"]}, owners
            share[TOKENS[token]["owner"]] = owners[0]
        assert share["alice"]["usage"] > share["bob"]["usage"] > 0
