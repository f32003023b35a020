"""/ui: the web page (queue, job, cluster views), static files served by the API itself.

The page is plain HTML, CSS and JavaScript under `api/ui/static` (uPlot vendored under `vendor/`), with no build
step and nothing fetched from elsewhere: it works offline on a cluster. It reads the same /v1 API as the CLI, with
the caller's bearer token (kept in sessionStorage, sent as a header, never in a URL), so it shows exactly what that
token may see. Every answer under /ui carries a Content-Security-Policy with no inline script and no eval.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, FastAPI
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, RedirectResponse
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

STATIC = Path(__file__).resolve().parent.parent / "ui" / "static"
CSP = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "connect-src 'self'",
        "img-src 'self' data:",
        "font-src 'self'",
        "form-action 'none'",
        "frame-ancestors 'none'",
        "base-uri 'none'",
        "object-src 'none'",
    )
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}
PAGE_HEADERS = {**HEADERS, "Cache-Control": "no-cache"}
JobId = Annotated[str, PathParam(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]

router = APIRouter(include_in_schema=False)


class UiStatic(StaticFiles):
    """The page's scripts, styles and vendored files, with the same headers as the pages."""

    async def get_response(self, path: str, scope: Scope):
        response = await super().get_response(path, scope)
        response.headers.update(HEADERS)
        return response


def _page(name: str) -> FileResponse:
    return FileResponse(STATIC / name, media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)


@router.api_route("/ui", methods=["GET", "HEAD"])
def queue_page() -> FileResponse:
    """Jobs by state, owner, queue, priority, position and reason, updated live from /v1/events."""
    return _page("queue.html")


@router.api_route("/ui/", methods=["GET", "HEAD"])
def queue_page_slash() -> RedirectResponse:
    return RedirectResponse("/ui", headers=HEADERS)


@router.api_route("/ui/jobs/{job_id}", methods=["GET", "HEAD"])
def job_page(job_id: JobId) -> FileResponse:
    """One job: spec, timeline, attempts, metrics across attempts, checkpoints, logs (the id is read by the script)."""
    return _page("job.html")


@router.api_route("/ui/cluster", methods=["GET", "HEAD"])
def cluster_page() -> FileResponse:
    """Nodes, free and total resources, queues and running jobs."""
    return _page("cluster.html")


def install(app: FastAPI) -> None:
    """The /ui routes and their static files."""
    app.include_router(router)
    app.mount("/ui/static", UiStatic(directory=STATIC), name="ui-static")
