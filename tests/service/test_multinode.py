"""Several Ray nodes on this machine: a lost node ends an attempt, and the job finishes from its checkpoint.

One node is removed in this module, under an elastic job (the last test):
the attempt ends `node_lost` and the next resumes from the last checkpoint. A rigid job's lost node differs from it
only in the retry decision (counted against `max_attempts`, no resize), which is table-tested
(`tests/service/test_policies.py`); a rigid job's retry from its checkpoint after a real lost worker is
`tests/service/test_faults.py`. Issue 34 folded the former rigid-job node-loss run (~55 s of a lane) into these."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.backends.ray_local import free_port
from tests.conftest import wait_for
from tests.service.conftest import MultiNode, Service, service_env, train_worker_nodes
from tests.service.test_e2e_serve import mlp_spec

pytestmark = pytest.mark.slow


def test_a_script_spread_over_two_nodes_keeps_each_nodes_part_of_its_checkpoints(
    multinode: MultiNode, tmp_path: Path
) -> None:
    """Script mode's outputs across nodes: an Accelerate loop on 2 workers placed on 2 nodes writes each checkpoint
    partly on each (rank 1's `random_states_1.pkl` only on its own node). Each node's syncer keeps its part; the
    rank-0 node seals the folder once both parts are in, and only then lists it."""
    import json

    from workers import manifest

    svc = Service(data_dir=tmp_path, port=free_port(), env={})
    svc.env = service_env(tmp_path, multinode.head, svc.port)
    svc.start()
    try:
        spec = {"name": "two-nodes", "entrypoint": {
                    "script": "examples/scripts/accelerate_loop.py", "outputs": ["out"],
                    "args": ["--output_dir", "out", "--max_steps", "8", "--checkpointing_steps", "4"]},
                "resources": {"num_workers": 2, "placement": "spread"}}  # fmt: skip
        with svc.client() as c:
            job = c.wait(c.submit(spec).id, timeout=300)
            assert job.state == "SUCCEEDED", job.last_error
            listed = [k for k in c.checkpoints(job.id) if k.complete]
        assert sorted(k.step for k in listed) == [4, 8]
        for k in listed:
            assert manifest.check(k.uri, checksums=True).complete
            parts = {p.name: json.loads(p.read_text()) for p in Path(k.uri, ".shunter-parts").glob("node-*.json")}
            assert sorted(parts) == ["node-0.json", "node-1.json"], parts
            assert "random_states_0.pkl" in parts["node-0.json"]["files"]
            assert set(parts["node-1.json"]["files"]) == {"random_states_1.pkl"}  # written on the other node only
            sealed = manifest.read(k.uri)["files"]
            assert {"random_states_0.pkl", "random_states_1.pkl", "model.safetensors"} <= set(sealed)
    finally:
        svc.stop()


def test_an_elastic_job_that_loses_a_node_shrinks_onto_the_rest(multinode: MultiNode, tmp_path: Path) -> None:
    """Issue 16: `num_workers: {min: 1, max: 3}` runs on all 3 nodes; one is removed without notice; the attempt ends
    `node_lost` and the job runs again at once at 2 workers, not counted against `max_attempts: 1`, with a
    `resized` event, from its last checkpoint."""
    svc = Service(data_dir=tmp_path, port=free_port(), env={})
    svc.env = service_env(tmp_path, multinode.head, svc.port)
    svc.start()
    try:
        spec = mlp_spec(total_steps=80, checkpoint_every=10, report_every=1, step_sleep=0.1)
        spec["resources"] = {"num_workers": {"min": 1, "max": 3}, "resources_per_worker": {"CPU": 1},
                             "placement": "spread"}  # fmt: skip
        spec["retries"] = {"max_attempts": 1, "backoff_seconds": 30, "max_worker_failures": 0}
        with svc.client() as c:
            job = c.submit(spec)
            wait_for(lambda: (c.get(job.id).step or 0) >= 15, timeout=180, what="job past its first checkpoint")
            assert c.get(job.id).world_size == 3
            nodes = train_worker_nodes(multinode.head.dashboard_url, f"shunter-{job.id}-1")
            victim = next(name for name, node in multinode.workers.items() if node.node_id in nodes)
            multinode.cluster.remove_node(multinode.workers[victim], allow_graceful=False)
            done = c.wait(job.id, timeout=300)
            assert done.state == "SUCCEEDED", done.last_error
            assert done.attempt == 2 and done.world_size == 2 and done.step == 80
            first, _ = c.attempts(job.id)
            assert first.end_reason == "node_lost", first.message
            assert [e.message for e in c.events(job.id) if e.reason == "resized"] == [
                "shrinks from 3 to 2 workers (attempt 2 resumes from the latest checkpoint at the new size)"
            ]
            resumed_at = min(m.step for m in c.metrics(job.id, name="loss") if m.attempt == 2)
            assert resumed_at == max(k.step for k in c.checkpoints(job.id) if k.attempt == 1) + 1
    finally:
        svc.stop()
