"""Fixtures for control-plane tests: a real SQLite file or a fresh PostgreSQL database per test, and a real
`shunter serve` process against the session's Ray head."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.engine import Engine

from api.client import Client
from service.backends.ray_jobs import RayJobs
from service.backends.ray_local import LocalHead, free_port
from service.backends.ray_start import LAUNCHER
from service.store.db import make_engine, reachable
from service.store.migrate import upgrade
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
    template = request.getfixturevalue("pg_schema_template")
    with fresh_pg_database(template=template) as url:
        engine = make_engine(url)
        yield engine
        engine.dispose()


@contextlib.contextmanager
def fresh_pg_database(prefix: str = "shunter_test", *, template: str | None = None) -> Iterator[str]:
    """A fresh PostgreSQL database, empty or a copy of `template`, dropped (connections and all) afterwards; yields
    its URL."""
    if not reachable(PG_ADMIN_URL):
        if os.environ.get("CI"):
            pytest.fail("PostgreSQL at 127.0.0.1:5432 is not reachable (CI must start it)")
        pytest.skip("PostgreSQL not reachable")
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = make_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else "")))
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
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def module_service(tmp_path_factory: pytest.TempPathFactory, ray_head: LocalHead) -> Iterator[Service]:
    """One `shunter serve` for a module's tests (a start is a few seconds of this machine's two cores)."""
    data_dir = tmp_path_factory.mktemp("service")
    svc = Service(data_dir=data_dir, port=free_port(), env=service_env(data_dir, ray_head, 0))
    svc.env["SHUNTER_PORT"] = str(svc.port)
    svc.start()
    yield svc
    svc.stop()
    stop_leftover_ray_jobs(ray_head)


@pytest.fixture
def service(module_service: Service, ray_head: LocalHead) -> Iterator[Service]:
    """The module's `shunter serve`, running (started again if a test before killed it), and left with nothing
    running for the next test: a test's jobs that did not end are cancelled through the API, then any Ray Job still
    up is stopped. Tests tell their jobs apart by id (a list of the module's jobs holds those of earlier tests)."""
    if module_service.proc is None or module_service.proc.poll() is not None:
        module_service.start()
    yield module_service
    if module_service.proc is not None and module_service.proc.poll() is None:
        cancel_unended(module_service)
    stop_leftover_ray_jobs(ray_head)


def cancel_unended(svc: Service) -> None:
    """Cancel every job of `svc` that has not ended and wait for their ends, so none is admitted after the test."""
    with svc.client() as c:
        unended = [j.id for j in c.list(limit=500).items if j.state not in ("SUCCEEDED", "FAILED", "CANCELLED")]
        for job_id in unended:
            with contextlib.suppress(Exception):  # it may have ended meanwhile (409)
                c.cancel(job_id)
        for job_id in unended:
            c.wait(job_id, timeout=120)


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


class Scenarios:
    """A module's independent end-to-end scenarios, run at the same time on the module's `shunter serve` (issue 34:
    their jobs' steps and epochs are mostly waits, and one attempt's start-up is a chain of single-threaded process
    starts, so two side by side take little more wall time than one). Each scenario is a function of the service and
    an `Event` it sets once its job is submitted; each keeps its own assertions. They start in the order they were
    added, each once the one before has submitted (so the queue's order is theirs), and a test reports its own:
    `outcomes.check(name)` re-raises what that scenario raised, with its traceback."""

    def __init__(self) -> None:
        self.funcs: dict[str, Callable[[Service, threading.Event], None]] = {}
        self.errors: dict[str, BaseException | None] = {}

    def add(self, fn: Callable[[Service, threading.Event], None]) -> Callable[[Service, threading.Event], None]:
        self.funcs[fn.__name__] = fn
        return fn

    def run(self, svc: Service, *, submit_patience: float = 120.0) -> Scenarios:
        threads = []
        for name, fn in self.funcs.items():
            submitted = threading.Event()

            def body(name: str = name, fn: Callable = fn, submitted: threading.Event = submitted) -> None:
                try:
                    fn(svc, submitted)
                    self.errors[name] = None
                except BaseException as exc:  # noqa: BLE001 - kept for the test that reports this scenario
                    self.errors[name] = exc
                finally:
                    submitted.set()

            thread = threading.Thread(target=body, name=f"scenario-{name}", daemon=True)
            thread.start()
            threads.append(thread)
            submitted.wait(submit_patience)
        for thread in threads:
            thread.join()
        return self

    def run_on_module_service(self, svc: Service, head: LocalHead) -> Scenarios:
        """`run` on a module's service (started again if a test before killed it), then leave nothing running on it,
        as the `service` fixture does after each test."""
        if svc.proc is None or svc.proc.poll() is not None:
            svc.start()
        self.run(svc)
        cancel_unended(svc)
        stop_leftover_ray_jobs(head)
        return self

    def check(self, name: str) -> None:
        assert name in self.errors, f"scenario {name} did not run"
        if self.errors[name] is not None:
            raise self.errors[name]


@dataclass
class MultiNode:
    """A Ray cluster of several nodes on this machine (`ray.cluster_utils.Cluster`), with its Jobs API."""

    cluster: object
    head: LocalHead
    workers: dict[str, object]  # name -> node handle
    swapped: set[str] = field(default_factory=set)  # nodes started with an environment of a test's own
    drained: set[str] = field(default_factory=set)  # nodes given a drain notice (`drain_node` on a MultiNode's node)

    def add_worker(self, name: str, env_vars: dict[str, str] | None = None) -> object:
        """Start worker node `name` (1 CPU, custom resource `node_<name>`) on its own address (127.0.0.2 for `a`, .3
        for `b`), as separate hosts are: Ray Train numbers nodes and local ranks by node IP, so nodes sharing the
        head's IP would count as one."""
        for attempt in (1, 2):
            try:
                node = self.cluster.add_node(  # type: ignore[attr-defined]
                    num_cpus=1, resources={f"node_{name}": 1},
                    node_ip_address=f"127.0.0.{2 + WORKER_NAMES.index(name)}", env_vars=env_vars,
                    setup_worker_path=LAUNCHER,
                )  # fmt: skip
                break
            except Exception as exc:
                # Ray 2.60's raylet aborts when its dashboard agent has not written its ports within a fixed 15 s,
                # which a loaded 2-core machine can miss (as tests/external_ray.py's heads did): start it once more.
                if attempt == 2:
                    raise
                print(f"node {name} did not start ({exc}); starting it again")
        self.workers[name] = node
        if env_vars:
            self.swapped.add(name)
        return node

    def swap(self, name: str, env_vars: dict[str, str]) -> object:
        """Replace node `name` by a fresh one whose raylet (and so its workers) has `env_vars`; `restore` undoes it."""
        self.cluster.remove_node(self.workers[name], allow_graceful=True)  # type: ignore[attr-defined]
        node = self.add_worker(name, env_vars)
        self.wait_for_nodes()
        return node

    def wait_for_nodes(self, timeout: float = 90) -> None:
        """Ray's live nodes are the cluster's: a node removed without grace counts as live until Ray's health check
        gives it up (`Cluster.wait_for_nodes` allows 30 s, less than that can take on a loaded machine)."""
        expected = len(self.cluster.list_all_nodes())  # type: ignore[attr-defined]
        live = self.cluster.global_state._live_node_ids  # type: ignore[attr-defined]
        wait_for(lambda: len(live()) == expected, timeout=timeout, what=f"{expected} live Ray nodes")

    def restore(self) -> None:
        """After a test: leftover jobs stopped, and nodes `a` and `b` as the cluster started them, alive, each with
        one free CPU (a test may have removed one, as an autoscaler or a spot reclaim would, or swapped one)."""
        stop_leftover_ray_jobs(self.head)
        changed = False
        for name in WORKER_NAMES:
            node = self.workers[name]
            there = node in self.cluster.worker_nodes  # type: ignore[attr-defined]
            if name in self.swapped or name in self.drained or not there:
                if there:
                    self.cluster.remove_node(node, allow_graceful=True)  # type: ignore[attr-defined]
                self.drained.discard(name)
                self.swapped.discard(name)
                self.add_worker(name)
                changed = True
        if changed:
            self.wait_for_nodes()


WORKER_NAMES = ("a", "b")


@contextlib.contextmanager
def multinode_cluster(tmp: Path) -> Iterator[MultiNode]:
    """Head (1 CPU) + nodes `a` and `b` (1 CPU each, with custom resources `node_a` / `node_b`); a test that needs a
    node with an environment of its own swaps it in (`MultiNode.swap`)."""
    from ray.cluster_utils import Cluster

    from service.backends.ray_local import head_environment

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
            # Ray's default (52365) is taken by any other head on this machine that kept it (another test run's
            # cluster): the second head's agent then serves no HTTP, and every job submission to it is refused
            # ("No available agent") until it times out. The added nodes already pick a free one (cluster_utils).
            "dashboard_agent_listen_port": free_port(),
            "resources": {"head": 1},
            # As service.backends.ray_start's nodes: Ray's set-up step without importing Ray.
            "setup_worker_path": LAUNCHER,
            # A node removed without grace is given up after 3 missed health checks 1 s apart instead of Ray's 5
            # at 3 s (15 s a node-loss test waits); each check still has Ray's 10 s to be answered, so a node slow
            # under load is not given up.
            "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 3},
        },
    )
    try:
        head = LocalHead(
            gcs_address=cluster.address, dashboard_url=f"http://127.0.0.1:{dashboard_port}", temp_dir=str(tmp)
        )
        mn = MultiNode(cluster=cluster, head=head, workers={})
        for name in WORKER_NAMES:
            mn.add_worker(name)
        cluster.wait_for_nodes()
        wait_for(lambda: httpx.get(f"{head.dashboard_url}/api/version").status_code == 200, what="dashboard")
        yield mn
    finally:
        cluster.shutdown()
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture
def multinode(session_multinode: MultiNode) -> Iterator[MultiNode]:
    """The session's 3-node cluster (`tests/conftest.py`), for one test, which may remove or swap nodes `a` and `b`:
    they are put back afterwards, as they started (one cluster start for every multi-node test instead of one each,
    about 20 s of this machine's two cores each time)."""
    yield session_multinode
    session_multinode.restore()


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
