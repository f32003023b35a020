"""Wiring for the long-running processes: which Ray, which database, and the dispatcher thread."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.engine import Engine

from service.backends.noop import NoopJobs
from service.backends.ray_jobs import RayJobs
from service.backends.ray_local import LocalHead, ensure_local_head, stop_local_head
from service.config import policies
from service.config.settings import Settings
from service.dispatch.dispatcher import Dispatcher
from service.store import migrate
from service.store.db import make_engine
from service.workflows import notifications
from service.workflows.webhooks import Sender

log = logging.getLogger(__name__)


def dashboard_url_for(settings: Settings) -> str:
    """The Jobs API address: explicit, or the default dashboard port on the GCS host."""
    if settings.ray_dashboard_url:
        return settings.ray_dashboard_url
    address = settings.ray_address or ""
    if address.startswith(("http://", "https://")):
        return address
    host = address.removeprefix("ray://").split(":")[0] or "127.0.0.1"
    return f"http://{host}:8265"


def gcs_address_for(settings: Settings) -> str | None:
    address = settings.ray_address or ""
    if not address or address.startswith(("http://", "https://", "ray://")):
        return None
    return address


@dataclass
class Runtime:
    """Everything a shunter process holds: the engine, the Ray adapter, and (maybe) a dispatcher thread."""

    settings: Settings
    engine: Engine
    ray: Any  # RayJobs, or NoopJobs for queue stress tests
    local_head: LocalHead | None = None
    dispatcher: Dispatcher | None = None
    _thread: threading.Thread | None = None
    _sender_thread: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def open(cls, settings: Settings, *, manage_local_ray: bool = False) -> Runtime:
        policies.check(settings)  # a mistake in a rule the settings configure stops start-up, naming its key
        engine = make_engine(settings.database_url)
        migrate.upgrade(engine)
        notifications.configure(engine, settings.webhooks)  # cluster-wide targets of the events this process writes
        head = None
        ray: Any
        if settings.backend.startswith("noop:"):
            ray = NoopJobs(settings.backend.removeprefix("noop:"))
        elif settings.ray_address is None and manage_local_ray:
            head = ensure_local_head(
                settings.data_dir.resolve(),
                num_cpus=settings.local_ray_num_cpus,
                num_gpus=settings.local_ray_num_gpus,
                dashboard_port=settings.local_ray_dashboard_port,
            )
            ray = RayJobs(head.dashboard_url, gcs_address=head.gcs_address)
        elif settings.ray_address is None:
            ray = RayJobs(dashboard_url_for(settings), drivers_off_head=settings.ray_drivers_off_head)
        else:
            ray = RayJobs(dashboard_url_for(settings), gcs_address=gcs_address_for(settings),
                          drivers_off_head=settings.ray_drivers_off_head)  # fmt: skip
        return cls(settings=settings, engine=engine, ray=ray, local_head=head)

    def start_dispatcher(self, *, owner: str) -> Dispatcher:
        self.dispatcher = Dispatcher(engine=self.engine, settings=self.settings, ray=self.ray, owner=owner)
        self._thread = threading.Thread(target=self.dispatcher.run, args=(self._stop,), name="dispatcher", daemon=True)
        self._thread.start()
        self._sender_thread = start_sender(self.engine, self.settings, self._stop)
        log.info("dispatcher %s started", owner)
        return self.dispatcher

    def close(self) -> None:
        self._stop.set()
        for thread in (self._thread, self._sender_thread):
            if thread is not None:
                thread.join(timeout=30)
        self.ray.close()
        if self.local_head is not None and self.settings.stop_ray_on_exit:
            log.info("stopping the local Ray head")
            stop_local_head(self.settings.data_dir.resolve())
        self.engine.dispose()


def start_sender(engine: Engine, settings: Settings, stop: threading.Event) -> threading.Thread:
    """The webhook sender (service.workflows.webhooks) runs beside every dispatcher, in a thread of its own: a slow
    receiver never slows admission."""
    sender = Sender(engine=engine, settings=settings)
    thread = threading.Thread(target=sender.run, args=(stop,), name="webhooks", daemon=True)
    thread.start()
    return thread


def run_dispatcher_process(dispatcher_cls: type[Dispatcher] = Dispatcher) -> None:
    """`shunter dispatcher`: one dispatcher loop in this process until SIGINT or SIGTERM."""
    import signal

    from service.config.settings import get_settings

    settings = get_settings()
    runtime = Runtime.open(settings)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    owner = settings.resolved_dispatcher_id()
    metrics = serve_dispatcher_metrics(settings)
    sender = start_sender(runtime.engine, settings, stop)
    try:
        dispatcher_cls(engine=runtime.engine, settings=settings, ray=runtime.ray, owner=owner).run(stop)
    finally:
        stop.set()
        sender.join(timeout=30)
        if metrics is not None:
            metrics.shutdown()
        runtime.close()


def serve_dispatcher_metrics(settings: Settings) -> Any:
    """A standalone dispatcher's /metrics (Prometheus text) on `dispatcher_metrics_host:port`, in a thread: its tick
    histogram and its process (CPU, memory, open files); counts by state, admissions and retries are the database's
    and come from any API's /metrics. None when the port is 0."""
    if not settings.dispatcher_metrics_port:
        return None
    from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server

    from service.collectors import InProcess
    from service.dispatch.timings import DISPATCHER_TICK_SECONDS

    registry = CollectorRegistry()
    registry.register(InProcess(DISPATCHER_TICK_SECONDS))
    ProcessCollector(registry=registry)
    try:
        server, _ = start_http_server(settings.dispatcher_metrics_port, settings.dispatcher_metrics_host, registry)
    except OSError as exc:  # another process has the port (two dispatchers on one host): dispatch on, unscraped
        log.warning("cannot serve the dispatcher's metrics on %s:%d (%s); set SHUNTER_DISPATCHER_METRICS_PORT "
                    "(0: none)", settings.dispatcher_metrics_host, settings.dispatcher_metrics_port, exc)  # fmt: skip
        return None
    log.info("dispatcher metrics on http://%s:%d/metrics", settings.dispatcher_metrics_host,
             settings.dispatcher_metrics_port)  # fmt: skip
    return server
