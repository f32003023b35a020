"""The FastAPI application: `create_app()` with a lifespan that owns the runtime (engine, Ray, dispatcher)."""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy import exc as sa_exc
from sqlalchemy import text
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route

from api import docs, metrics
from api.deps import RuntimeDep
from api.gate import FairGate, Gate
from api.limits import BodyLimit
from api.routes import attempt_secrets as attempt_secrets_routes
from api.routes import cluster as cluster_routes
from api.routes import code as code_routes
from api.routes import events as events_routes
from api.routes import internal as internal_routes
from api.routes import job_logs as job_logs_routes
from api.routes import jobs as jobs_routes
from api.routes import notifications as notifications_routes
from api.routes import queues as queues_routes
from api.routes import secrets as secrets_routes
from api.routes import sweeps as sweeps_routes
from api.routes import ui as ui_routes
from api.routes import usage as usage_routes
from api.schemas import ReadyBody
from api.streams import RETRY_AFTER_SECONDS, is_database_outage
from service.config.settings import Settings
from service.core.errors import ShunterError
from service.runtime import Runtime
from service.tenancy import attempt_tokens

log = logging.getLogger(__name__)


_FIELD_IN_MESSAGE = re.compile(r"^([a-z_]+(?:\.[a-z_0-9]+)+)\s*[:=]")


def _field_of(loc: tuple[Any, ...] | list[Any], message: str = "") -> str:
    """The dotted field path of a validation error; a model-level check names its field in its message."""
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header") and not isinstance(p, int)]
    # pydantic adds the union branch / validator name to a loc ("function-after[...]"): not part of the field path.
    field = ".".join(p for p in parts if "[" not in p)
    named = _FIELD_IN_MESSAGE.match(message)
    if named and (not field or named.group(1).startswith(field)):
        return named.group(1)
    return field or "body"


def credential_owners(settings: Settings, runtime: Callable[[], Runtime | None]) -> Callable[[str], str | None]:
    """Who a bearer credential speaks for, for the fair gate, without a database read: a user token's owner (looked
    up by its hash), or the owner signed into an attempt token (checked with the keys in memory; None until they are
    read once)."""
    owners = {hashlib.sha256(t.encode()).digest(): info.owner for t, info in (settings.api_tokens or {}).items()}

    def owner_of(presented: str) -> str | None:
        if presented.startswith(attempt_tokens.PREFIX + "."):
            rt = runtime()
            keys = attempt_tokens.cached_keys(None if rt is None else rt.engine, settings)
            return None if keys is None else attempt_tokens.owner_of(presented, keys.accepted)
        return owners.get(hashlib.sha256(presented.encode()).digest())

    return owner_of


def _allowed_methods(request: Request) -> str:
    """Every method some route of this path takes (Starlette's own `Allow` names only the first route's)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        if isinstance(route, Route) and route.methods and route.matches(request.scope)[0] != Match.NONE:
            methods |= route.methods
    return ", ".join(sorted(methods))


def create_app(
    settings: Settings | None = None,
    *,
    runtime: Runtime | None = None,
    run_dispatcher: bool = False,
    manage_local_ray: bool = False,
    dispatcher_id: str | None = None,
    on_ready: Callable[[Runtime], None] | None = None,
) -> FastAPI:
    """The API; with `run_dispatcher` the same process also runs the dispatcher loop (`shunter serve`). `on_ready`
    is called once the runtime is open (e.g. to print where the API, the web page and the Ray dashboard are)."""
    settings = settings or (runtime.settings if runtime else Settings())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        rt = runtime or Runtime.open(settings, manage_local_ray=manage_local_ray)
        app.state.runtime = rt
        collector = metrics.attach(registry, rt)
        if run_dispatcher:
            rt.start_dispatcher(owner=dispatcher_id or settings.resolved_dispatcher_id())
        if on_ready is not None:
            on_ready(rt)
        try:
            yield
        finally:
            registry.unregister(collector)
            if runtime is None:
                rt.close()

    app = FastAPI(
        title="shunter",
        version="0.1.0",
        summary="A durable queue in front of Ray Train: submit distributed training jobs, watch them, get them back.",
        lifespan=lifespan,
        docs_url=None,  # api.docs serves Swagger UI from the package, not a CDN
        redoc_url=None,
    )

    per_path = {
        "/v1/code": settings.max_code_bytes,
        # Reports are small: never more than the attempt API's own bound, nor than the service's.
        internal_routes.PREFIX: min(settings.max_body_bytes, internal_routes.MAX_BODY_BYTES),
    }
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, per_path=per_path)
    registry = metrics.install(app)
    # Outermost: a request waits for its place before its body is read or its latency is timed.
    gate = Gate(capacity=settings.api_concurrency, waiting_per_caller=settings.api_waiting_per_caller,
                max_wait_seconds=settings.api_max_wait_seconds)  # fmt: skip
    app.add_middleware(
        FairGate, gate=gate, owner_of=credential_owners(settings, lambda: getattr(app.state, "runtime", None))
    )
    app.state.gate = gate
    registry.register(metrics.GateCollector(gate))

    @app.exception_handler(ShunterError)
    async def _shunter_error(_: Request, exc: ShunterError) -> JSONResponse:
        headers = dict(getattr(exc, "headers", None) or {})  # e.g. Retry-After on a 429 (api.streams)
        if exc.status_code == 503:
            headers.setdefault("Retry-After", str(RETRY_AFTER_SECONDS))
        return JSONResponse(status_code=exc.status_code, content=exc.to_body(), headers=headers or None)

    async def _database_unavailable(request: Request, exc: Exception) -> JSONResponse:
        """The database cannot be reached (down, dropped, restarting, its pool exhausted): 503, as documented."""
        if not is_database_outage(exc):
            return await _unexpected(request, exc)  # a wrong statement is a bug: 500
        log.warning("database unavailable: %s %s: %s", request.method, request.url.path, exc)
        body = {"detail": "the database does not answer; try again", "code": "unavailable"}
        return JSONResponse(status_code=503, content=body, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})

    for db_error in (sa_exc.DBAPIError, sa_exc.TimeoutError, sa_exc.DisconnectionError):
        app.add_exception_handler(db_error, _database_unavailable)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = []
        for e in exc.errors():
            message = str(e.get("msg", "")).removeprefix("Value error, ")
            errors.append({"field": _field_of(e.get("loc", ()), message), "message": message})
        summary = "; ".join(f"{e['field']}: {e['message']}" for e in errors)
        body = {"detail": summary, "code": "invalid_request", "field": errors[0]["field"] if errors else None}
        return JSONResponse(status_code=422, content={**body, "errors": errors})

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and "parsing the body" in str(exc.detail):
            # A body that is not even text (bad UTF-8) is invalid JSON like any other: the same 422.
            body = {"detail": "body: not valid JSON", "code": "invalid_request", "field": "body"}
            return JSONResponse(status_code=422, content=body)
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:
            headers["Allow"] = _allowed_methods(request)  # RFC 9110: a 405 names what the path does allow
        return JSONResponse(
            status_code=exc.status_code,
            content={"detail": str(exc.detail), "code": "http_error"},
            headers=headers or None,
        )

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # Never a traceback in a body: log it here, give the client a stable code.
        log.exception("unhandled error", exc_info=exc)
        return JSONResponse(
            status_code=500, content={"detail": "internal error; see the server log", "code": "internal"}
        )

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, str]:
        """The process answers."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"], response_model=ReadyBody, responses={503: {"model": ReadyBody}})
    def readyz(rt: RuntimeDep) -> JSONResponse:
        """Ready when both the database and Ray answer; `why` names what is not."""
        checks = {"database": False, "ray": False}
        why: dict[str, str] = {}
        try:
            with rt.engine.connect() as conn:
                conn.execute(text("SELECT 1"))
            checks["database"] = True
        except Exception as exc:  # noqa: BLE001 - any failure means not ready
            log.warning("readiness: database check failed", exc_info=True)
            why["database"] = f"not ready: database: {type(exc).__name__}"
        problem = rt.ray.problem()
        checks["ray"] = problem is None
        if problem is not None:
            why["ray"] = f"not ready: Ray: {problem}"
        ready = all(checks.values())
        body = {"ready": ready, "checks": checks, "why": why}
        return JSONResponse(status_code=200 if ready else 503, content=body)

    app.include_router(jobs_routes.router)
    app.include_router(job_logs_routes.router)
    app.include_router(notifications_routes.router)
    app.include_router(events_routes.router)
    app.include_router(cluster_routes.router)
    app.include_router(queues_routes.router)
    app.include_router(usage_routes.router)
    app.include_router(sweeps_routes.router)
    app.include_router(code_routes.router)
    app.include_router(secrets_routes.router)
    app.include_router(metrics.router)
    app.include_router(internal_routes.router)
    app.include_router(attempt_secrets_routes.router)
    ui_routes.install(app)
    docs.install(app)
    return app
