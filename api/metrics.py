"""`GET /metrics` (Prometheus text) and the request-latency middleware feeding it; one registry per app."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.deps import get_caller
from api.gate import Gate
from api.schemas import ERROR_RESPONSES
from service.collectors import DatabaseCollector, InProcess
from service.dispatch.timings import DISPATCHER_TICK_SECONDS
from service.runtime import Runtime
from service.tenancy.auth import Caller

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
router = APIRouter(tags=["health"])


class RequestLatency:
    """Time to the response's first byte (a stream's length is not its latency), by method, route and status."""

    def __init__(self, app: ASGIApp, histogram: Histogram) -> None:
        self.app = app
        self.histogram = histogram

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()

        async def timed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                route = scope.get("route")
                # The route's template, never the raw path: one series per endpoint, not per job id.
                template = getattr(route, "path", None) or "unmatched"
                self.histogram.labels(scope["method"], template, str(message["status"])).observe(
                    time.perf_counter() - started
                )
            await send(message)

        await self.app(scope, receive, timed_send)


class GateCollector:
    """The fair gate's state in this process (api.gate): requests computing and waiting, and those refused."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("shunter_api_requests_computing", "requests holding a place in the API's gate",
                                value=self.gate.computing())  # fmt: skip
        yield GaugeMetricFamily("shunter_api_requests_waiting", "requests waiting for a place in the API's gate",
                                value=self.gate.waiting())  # fmt: skip
        refused = CounterMetricFamily(
            "shunter_api_requests_refused",
            "requests the gate refused: `full` (429, the caller's waiting line full), `late` (503, no place in time)",
            labels=["reason"],
        )
        refused.add_metric(["full"], self.gate.refused_full)
        refused.add_metric(["late"], self.gate.refused_late)
        yield refused


def install(app: FastAPI) -> CollectorRegistry:
    """A registry for this app with the latency middleware; `attach` adds the database-backed collector."""
    registry = CollectorRegistry(auto_describe=False)
    latency = Histogram(
        "shunter_http_request_duration_seconds", "API request latency (to the first byte)",
        ["method", "route", "status"], buckets=LATENCY_BUCKETS, registry=registry,
    )  # fmt: skip
    registry.register(InProcess(DISPATCHER_TICK_SECONDS))
    app.add_middleware(RequestLatency, histogram=latency)
    app.state.metrics_registry = registry
    return registry


def attach(registry: CollectorRegistry, runtime: Runtime) -> DatabaseCollector:
    def last_tick() -> float | None:
        return runtime.dispatcher.last_tick_seconds if runtime.dispatcher is not None else None

    collector = DatabaseCollector(runtime.engine, last_tick=last_tick)
    registry.register(collector)
    return collector


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus text"},
        401: ERROR_RESPONSES[401],
    },
)
def metrics(request: Request, caller: Annotated[Caller, Depends(get_caller)]) -> Response:
    """Prometheus metrics: jobs by state and queue, queue wait, admissions, retries, CPU/GPU seconds by owner and
    queue, tick and request latency.

    With API tokens configured, scrape with any valid token (Prometheus `authorization: {credentials: ...}`). The
    series labelled by owner are every owner's for an admin token and the caller's own for any other (another
    owner's usage is theirs, as on /v1/usage: issue 35).
    """
    registry = request.app.state.metrics_registry
    shown = registry if caller.admin else _OwnSeries(registry, caller.owner)
    return Response(generate_latest(shown), media_type=CONTENT_TYPE_LATEST)


class _OwnSeries:
    """A registry's metrics less the samples labelled with another owner (what `generate_latest` reads)."""

    def __init__(self, registry: CollectorRegistry, owner: str) -> None:
        self.registry, self.owner = registry, owner

    def collect(self) -> Iterator[Metric]:
        for metric in self.registry.collect():
            if any("owner" in s.labels for s in metric.samples):
                metric.samples = [s for s in metric.samples if s.labels.get("owner", self.owner) == self.owner]
            yield metric
