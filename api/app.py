"""The FastAPI application: `create_app()` with a lifespan that owns the runtime (engine, Ray, dispatcher)."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy import text
from starlette.exceptions import HTTPException as StarletteHTTPException

from api import metrics
from api.deps import RuntimeDep
from api.routes import cluster as cluster_routes
from api.routes import events as events_routes
from api.routes import jobs as jobs_routes
from api.routes import queues as queues_routes
from api.schemas import ReadyBody
from service.errors import ShunterError
from service.runtime import Runtime
from service.settings import Settings

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


def create_app(
    settings: Settings | None = None,
    *,
    runtime: Runtime | None = None,
    run_dispatcher: bool = False,
    manage_local_ray: bool = False,
    dispatcher_id: str | None = None,
) -> FastAPI:
    """The API; with `run_dispatcher` the same process also runs the dispatcher loop (`shunter serve`)."""
    settings = settings or (runtime.settings if runtime else Settings())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        rt = runtime or Runtime.open(settings, manage_local_ray=manage_local_ray)
        app.state.runtime = rt
        collector = metrics.attach(registry, rt)
        if run_dispatcher:
            rt.start_dispatcher(owner=dispatcher_id or settings.resolved_dispatcher_id())
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
    )

    registry = metrics.install(app)

    @app.exception_handler(ShunterError)
    async def _shunter_error(_: Request, exc: ShunterError) -> JSONResponse:
        return JSONResponse(status_code=exc.status_code, content=exc.to_body())

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
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and "parsing the body" in str(exc.detail):
            # A body that is not even text (bad UTF-8) is invalid JSON like any other: the same 422.
            body = {"detail": "body: not valid JSON", "code": "invalid_request", "field": "body"}
            return JSONResponse(status_code=422, content=body)
        return JSONResponse(status_code=exc.status_code, content={"detail": str(exc.detail), "code": "http_error"})

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
        """Ready when both the database and Ray answer."""
        checks = {"database": False, "ray": False}
        try:
            with rt.engine.connect() as conn:
                conn.execute(text("SELECT 1"))
            checks["database"] = True
        except Exception:  # noqa: BLE001 - any failure means not ready
            log.warning("readiness: database check failed", exc_info=True)
        checks["ray"] = rt.ray.ping()
        ready = all(checks.values())
        return JSONResponse(status_code=200 if ready else 503, content={"ready": ready, "checks": checks})

    app.include_router(jobs_routes.router)
    app.include_router(events_routes.router)
    app.include_router(cluster_routes.router)
    app.include_router(queues_routes.router)
    app.include_router(metrics.router)
    return app
