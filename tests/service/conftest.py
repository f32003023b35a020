"""Fixtures for control-plane tests: a real SQLite file or a fresh PostgreSQL database per test, and a real
`shunter serve` process against the session's Ray head."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.engine import Engine

from api.client import Client
from service.db import make_engine, reachable
from service.migrate import upgrade
from service.ray_jobs import RayJobs
from service.ray_local import LocalHead, free_port
from tests.conftest import wait_for

PG_ADMIN_URL = os.environ.get("SHUNTER_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    """A fresh, empty database with shunter's schema: a SQLite file, or a new PostgreSQL database."""
    if request.param == "sqlite":
        engine = make_engine(f"sqlite:///{tmp_path / 'shunter.db'}")
        upgrade(engine)
        yield engine
        engine.dispose()
        return
    with fresh_pg_database() as url:
        engine = make_engine(url)
        upgrade(engine)
        yield engine
        engine.dispose()


@contextlib.contextmanager
def fresh_pg_database(prefix: str = "shunter_test") -> Iterator[str]:
    """A fresh, empty PostgreSQL database, dropped (connections and all) afterwards; yields its URL."""
    if not reachable(PG_ADMIN_URL):
        if os.environ.get("CI"):
            pytest.fail("PostgreSQL at 127.0.0.1:5432 is not reachable (CI must start it)")
        pytest.skip("PostgreSQL not reachable")
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = make_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@dataclass
class Service:
    """A real `shunter serve` process (API + dispatcher) against the session's Ray head."""

    data_dir: Path
    port: int
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log_path = self.data_dir / "serve.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> Client:
        return Client(self.url)

    def start(self) -> Service:
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "api.cli", "serve"], env=self.env, stdout=log, stderr=subprocess.STDOUT,
            cwd=Path(__file__).resolve().parents[2], start_new_session=True,
        )  # fmt: skip
        wait_for(self._ready, timeout=60, what=f"shunter serve on {self.url} (log: {self.log_path})")
        return self

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"shunter serve exited {self.proc.returncode}: {self.log_path.read_text()[-3000:]}")
        try:
            return httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def kill9(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "api.cli", *args, "--server", self.url], capture_output=True, text=True,
            env=self.env, timeout=120, check=check, cwd=Path(__file__).resolve().parents[2],
        )  # fmt: skip


def service_env(data_dir: Path, head: LocalHead, port: int, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "SHUNTER_DATABASE_URL": f"sqlite:///{data_dir / 'shunter.db'}",
            "SHUNTER_DATA_DIR": str(data_dir),
            "SHUNTER_STORAGE_URI": str(data_dir / "checkpoints"),
            "SHUNTER_RAY_ADDRESS": head.gcs_address,
            "SHUNTER_RAY_DASHBOARD_URL": head.dashboard_url,
            "SHUNTER_PORT": str(port),
            "SHUNTER_DISPATCHER_TICK_SECONDS": "0.25",
            "SHUNTER_TRAIN_POLL_SECONDS": "0.1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update(extra)
    return env


@pytest.fixture
def service(tmp_path: Path, ray_head: LocalHead) -> Iterator[Service]:
    svc = Service(data_dir=tmp_path, port=free_port(), env=service_env(tmp_path, ray_head, 0))
    svc.env["SHUNTER_PORT"] = str(svc.port)
    svc.start()
    yield svc
    svc.stop()
    stop_leftover_ray_jobs(ray_head)


def stop_leftover_ray_jobs(head: LocalHead) -> None:
    """A failed test must not leave a training job holding the shared cluster's CPUs for the next one."""
    ray = RayJobs(head.dashboard_url)
    try:
        for sub_id in ray.list_submission_ids():
            info = ray.info(sub_id)
            if info is not None and not info.is_terminal:
                ray.stop(sub_id)
                wait_for(lambda s=sub_id: ray.info(s).is_terminal, timeout=60, what=f"{sub_id} to stop")
    finally:
        ray.close()


@dataclass
class MultiNode:
    """A Ray cluster of several nodes on this machine (`ray.cluster_utils.Cluster`), with its Jobs API."""

    cluster: object
    head: LocalHead
    workers: dict[str, object]  # name -> node handle


@contextlib.contextmanager
def multinode_cluster(tmp: Path, node_env: dict[str, dict[str, str]] | None = None) -> Iterator[MultiNode]:
    """Head (1 CPU) + nodes `a` and `b` (1 CPU each, with custom resources `node_a` / `node_b`); `node_env`: extra
    environment of a worker node's raylet, by name, which its workers inherit."""
    from ray.cluster_utils import Cluster

    from service.ray_local import head_environment

    saved = dict(os.environ)
    # Node processes inherit this environment: the venv's python on PATH for `python -m workers.driver`,
    # the checkout on PYTHONPATH for `examples.*`, graceful stops.
    os.environ.update(head_environment(str(Path(__file__).resolve().parents[2])))
    dashboard_port = free_port()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "include_dashboard": True,
            "dashboard_host": "127.0.0.1",
            "dashboard_port": dashboard_port,
            "resources": {"head": 1},
        },
    )
    try:
        # Each worker node on an address of its own (127.0.0.2, .3), as separate hosts are: Ray Train numbers
        # nodes and local ranks by node IP, so nodes sharing the head's IP would count as one.
        workers = {
            name: cluster.add_node(
                num_cpus=1,
                resources={f"node_{name}": 1},
                node_ip_address=f"127.0.0.{2 + i}",
                env_vars=(node_env or {}).get(name),
            )  # fmt: skip
            for i, name in enumerate(("a", "b"))
        }
        cluster.wait_for_nodes()
        head = LocalHead(
            gcs_address=cluster.address, dashboard_url=f"http://127.0.0.1:{dashboard_port}", temp_dir=str(tmp)
        )
        wait_for(lambda: httpx.get(f"{head.dashboard_url}/api/version").status_code == 200, what="dashboard")
        yield MultiNode(cluster=cluster, head=head, workers=workers)
    finally:
        cluster.shutdown()
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture
def multinode(tmp_path: Path) -> Iterator[MultiNode]:
    """A fresh 3-node cluster for one test (tests that remove nodes)."""
    with multinode_cluster(tmp_path) as mn:
        yield mn


@pytest.fixture(scope="module")
def multinode_shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MultiNode]:
    """One 3-node cluster for a module's tests (each leaves it as it found it)."""
    with multinode_cluster(tmp_path_factory.mktemp("multinode")) as mn:
        yield mn


def train_worker_nodes(dashboard_url: str, submission_id: str) -> list[str]:
    """Node ids of the live RayTrainWorker actors of one Ray Job."""
    from ray.util.state import list_actors

    ray_job_id = httpx.get(f"{dashboard_url}/api/jobs/{submission_id}", timeout=10).json()["job_id"]
    actors = list_actors(address=dashboard_url, filters=[("state", "=", "ALIVE")], limit=1000)
    return [a.node_id for a in actors if a.job_id == ray_job_id and "RayTrainWorker" in (a.class_name or "")]


def drain_node(gcs_address: str, node_id: str, *, deadline_s: int, message: str = "spot instance reclaimed") -> float:
    """Announce a node's end the way an autoscaler does (`ray drain-node`, the GCS DrainNode call with reason
    PREEMPTION and a deadline); the node keeps running until the caller removes it. Returns when it was announced."""
    ray_cli = Path(sys.executable).parent / "ray"
    subprocess.run(
        [str(ray_cli), "drain-node", "--address", gcs_address, "--node-id", node_id, "--reason",
         "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", message, "--deadline-remaining-seconds", str(deadline_s)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return time.monotonic()
