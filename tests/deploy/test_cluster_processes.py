"""The cluster deployment, for real, on this machine: a two-node Ray cluster started with `ray start`, PostgreSQL,
two `shunter api` and two `shunter dispatcher` processes.

A 2-worker spread job is submitted through one API and followed through the other; its workers land on both Ray
nodes and rendezvous across them; the dispatcher holding its lease is SIGKILLed mid-run and the other one adopts
the job and carries it to SUCCEEDED without submitting it to Ray a second time.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest
from sqlalchemy import text

from api.client import Client
from service.backends.ray_jobs import RayJobs
from service.backends.ray_local import (
    RAY_START,
    LocalHead,
    ensure_local_head,
    free_port,
    head_environment,
    stop_local_head,
)
from service.store.db import make_engine
from tests.conftest import wait_for
from tests.service.conftest import fresh_pg_database, train_worker_nodes
from tests.service.test_e2e_serve import mlp_spec

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


# ---- processes we start, and only those, are the ones we stop ---------------------------------------------------
@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def kill9(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.popen.wait(timeout=10)

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM the process group, SIGKILL it after `grace` seconds."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=grace)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)  # stragglers of the group, if any
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)


def spawn(name: str, args: list[str], *, env: dict[str, str], log_dir: Path) -> Proc:
    log_path = log_dir / f"{name}.log"
    log = open(log_path, "ab")  # noqa: SIM115 - the child keeps it
    popen = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    return Proc(name=name, popen=popen, log_path=log_path)


def processes_of_cluster(temp_dir: str, gcs_address: str) -> list[int]:
    """Every process of our Ray cluster: each carries its session dir or the GCS address in its command line."""
    pids = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info.get("cmdline") or [])
        if (temp_dir in cmdline or gcs_address in cmdline) and proc.info["pid"] != os.getpid():
            pids.append(proc.info["pid"])
    return pids


# ---- fixtures ---------------------------------------------------------------------------------------------------
@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh PostgreSQL database, dropped (connections and all) afterwards."""
    with fresh_pg_database("shunter_deploy") as url:
        yield url


@dataclass
class TwoNodeRay:
    head: LocalHead
    node_b: str  # node id of the second node


@pytest.fixture
def two_node_ray(tmp_path: Path) -> Iterator[TwoNodeRay]:
    """`ray start --head` (1 CPU) plus a second `ray start --address ...` node (1 CPU, custom resource `node_b`)."""
    data_dir = tmp_path / "ray"
    head = ensure_local_head(data_dir, num_cpus=1, num_gpus=0)
    try:
        # The worker node's processes inherit this: the venv on PATH (`python -m workers.driver`), the checkout on
        # PYTHONPATH (`examples.mlp`), graceful stops.
        cmd = [
            *RAY_START, f"--address={head.gcs_address}",
            "--node-ip-address=127.0.0.1", "--num-cpus=1", "--num-gpus=0", "--resources=" + json.dumps({"node_b": 1}),
            # Ports that default to fixed numbers collide with the head's (or another engineer's) on one machine.
            f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}",
            "--disable-usage-stats",
        ]  # fmt: skip
        proc = subprocess.run(cmd, env=head_environment(str(REPO)), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"ray start (node b) failed: {proc.stderr[-2000:]}"
        ray = RayJobs(head.dashboard_url, gcs_address=head.gcs_address)
        try:
            nodes = wait_for(
                lambda: [n for n in ray.cluster().nodes if n.alive and n.total.get("node_b")],
                timeout=60,
                what="node b registered with the GCS",
            )
        finally:
            ray.close()
        yield TwoNodeRay(head=head, node_b=nodes[0].node_id)  # type: ignore[index]
    finally:
        pids = processes_of_cluster(head.temp_dir, head.gcs_address)
        stop_local_head(data_dir)
        # Node b's processes, if any outlived the head's stop: never `ray stop` (it ends every Ray on the machine).
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


@dataclass
class Deployment:
    apis: list[tuple[Proc, str]]  # (process, base URL)
    dispatchers: list[Proc]
    pg_url: str
    head: LocalHead

    def all(self) -> list[Proc]:
        return [p for p, _ in self.apis] + self.dispatchers


def shunter_env(tmp_path: Path, name: str, *, pg_url: str, head: LocalHead, port: int = 0) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHUNTER_")}
    env.update(
        {
            "SHUNTER_DATABASE_URL": pg_url,
            "SHUNTER_RAY_ADDRESS": head.gcs_address,
            "SHUNTER_RAY_DASHBOARD_URL": head.dashboard_url,
            "SHUNTER_STORAGE_URI": str(tmp_path / "checkpoints"),  # shared by every node: one machine here
            "SHUNTER_DATA_DIR": str(tmp_path / name),
            "SHUNTER_DISPATCHER_TICK_SECONDS": "0.25",
            "SHUNTER_LEASE_SECONDS": "5",
            "PYTHONUNBUFFERED": "1",
        }
    )
    if port:
        env["SHUNTER_PORT"] = str(port)
    return env


def _api_ready(proc: Proc, url: str) -> bool:
    if not proc.alive():
        raise AssertionError(f"{proc.name} exited {proc.popen.returncode}: {proc.tail()}")
    try:
        return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def deployment(tmp_path: Path, pg_url: str, two_node_ray: TwoNodeRay) -> Iterator[Deployment]:
    head = two_node_ray.head
    logs = tmp_path / "logs"
    logs.mkdir()
    dep = Deployment(apis=[], dispatchers=[], pg_url=pg_url, head=head)
    try:
        for i in (1, 2):
            port = free_port()
            env = shunter_env(tmp_path, f"api{i}", pg_url=pg_url, head=head, port=port)
            proc = spawn(f"api{i}", [sys.executable, "-m", "api.cli", "api"], env=env, log_dir=logs)
            dep.apis.append((proc, f"http://127.0.0.1:{port}"))
            if i == 1:
                # The first process creates the schema; the rest start together against it.
                wait_for(lambda p=proc, u=dep.apis[0][1]: _api_ready(p, u), timeout=90, what="api1 ready")
        for i in (1, 2):
            env = shunter_env(tmp_path, f"dispatcher{i}", pg_url=pg_url, head=head)
            env["SHUNTER_PUBLIC_URL"] = dep.apis[i - 1][1]  # where its jobs report: an API, not the dispatcher
            dep.dispatchers.append(
                spawn(f"dispatcher{i}", [sys.executable, "-m", "api.cli", "dispatcher"], env=env, log_dir=logs)
            )
        for proc, url in dep.apis:
            wait_for(lambda p=proc, u=url: _api_ready(p, u), timeout=90, what=f"{proc.name} ready")
        yield dep
    finally:
        for proc in dep.all():
            proc.stop()
        ray = RayJobs(head.dashboard_url)
        with contextlib.suppress(Exception):
            for sub_id in ray.list_submission_ids():
                ray.stop(sub_id)
        ray.close()


def _lease_owner(pg_url: str, job_id: str) -> str | None:
    engine = make_engine(pg_url)
    try:
        with engine.connect() as conn:
            return conn.execute(text("SELECT lease_owner FROM jobs WHERE id = :id"), {"id": job_id}).scalar()
    finally:
        engine.dispose()


# ---- the test ---------------------------------------------------------------------------------------------------
def test_spread_job_across_two_nodes_survives_dispatcher_kill(deployment: Deployment, two_node_ray: TwoNodeRay) -> None:
    started = time.monotonic()
    (_, api1), (_, api2) = deployment.apis
    spec = mlp_spec(total_steps=200, checkpoint_every=50, report_every=5, step_sleep=0.1)
    spec["name"] = "mlp-cluster"
    spec["resources"]["placement"] = "spread"
    with Client(api1) as submit_api, Client(api2) as watch_api:
        job = submit_api.submit(spec)
        wait_for(lambda: watch_api.get(job.id).state == "RUNNING", timeout=180, what="job RUNNING (seen via api2)")
        wait_for(lambda: (watch_api.get(job.id).step or 0) >= 10, timeout=120, what="job past step 10")
        sub_id = f"shunter-{job.id}-1"

        # Placement: one train worker on each Ray node, as Ray's own state API sees them.
        nodes = train_worker_nodes(deployment.head.dashboard_url, sub_id)
        assert len(nodes) == 2 and len(set(nodes)) == 2, f"workers not spread over two nodes: {nodes}"
        assert two_node_ray.node_b in nodes

        # Kill the dispatcher that holds the lease (its id is <hostname>:<pid>), mid-run, without warning.
        owner = _lease_owner(deployment.pg_url, job.id)
        assert owner, "a running job must be leased"
        by_pid = {p.pid: p for p in deployment.dispatchers}
        holder = by_pid[int(owner.rsplit(":", 1)[1])]
        survivor = next(p for p in deployment.dispatchers if p is not holder)
        step_at_kill = watch_api.get(job.id).step or 0
        holder.kill9()
        assert survivor.alive(), survivor.tail()

        done = watch_api.wait(job.id, timeout=300)
        assert done.state == "SUCCEEDED", f"{done.last_error}\n{survivor.tail()}"
        assert done.step == 200 and done.attempt == 1
        assert step_at_kill < 200, "the job ended before the dispatcher was killed: nothing was tested"

        events = watch_api.events(job.id)
        history = [(e.kind, e.reason, e.actor, e.message) for e in events]
        # The survivor (its id: <hostname>:<its pid>) took the lease over from the killed holder. (The event's
        # message is not checked: service/queue.take_over reads the old owner after its UPDATE synced the new one.)
        adopted = [e for e in events if e.reason == "adopted" and (e.actor or "").endswith(f":{survivor.pid}")]
        assert adopted, history
        finished = [e for e in events if e.to_state == "SUCCEEDED"]
        assert finished[0].actor == adopted[0].actor, history
        # One Ray submission, under attempt 1's id: the survivor watched the running Ray Job, it did not resubmit.
        assert [e.reason for e in events].count("ray_job_submitted") == 1, history
        assert "ray_job_adopted" not in [e.reason for e in events], history
        ray = RayJobs(deployment.head.dashboard_url)
        try:
            assert ray.list_submission_ids(prefix=f"shunter-{job.id}-") == [sub_id]
            # The job ended on its driver's word, once its final report landed; Ray's own end of the Ray Job follows
            # when Ray Train's teardown and the driver's exit are done, and it must be a success too.
            wait_for(lambda: getattr(ray.info(sub_id), "status", None) in ("SUCCEEDED", "FAILED", "STOPPED"),
                     timeout=120, what="Ray's end of the Ray Job")  # fmt: skip
            info = ray.info(sub_id)
            assert info is not None and info.status == "SUCCEEDED", info
        finally:
            ray.close()
        assert len(watch_api.attempts(job.id)) == 1
        # Both APIs answer the same truth from the database.
        assert submit_api.get(job.id).state == "SUCCEEDED"
    print(f"cluster test body took {time.monotonic() - started:.1f}s; killed {owner}, adopted by {adopted[0].actor}")
