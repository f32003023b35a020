"""`/docs`: Swagger UI from the service itself. FastAPI's default page loads `swagger-ui-dist@5` from a CDN: blank on
the air-gapped clusters this service runs on, and a third party's script, without integrity checks, on the origin
where `/ui` keeps its token (issue 35). The files come from the `swagger-ui-bundle-v2` package and are served under
`/docs/assets`; ReDoc (CDN only) is not offered."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from swagger_ui_bundle import swagger_ui_path

ASSETS = "/docs/assets"
# The page's only script is its own inline start-up; everything else comes from this origin.
CSP = ("default-src 'none'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
       "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")  # fmt: skip
# Only what the page loads: not the bundle's sample index.html or its ES-module builds.
_SERVED = ("swagger-ui-bundle.js", "swagger-ui.css", "favicon-32x32.png", "oauth2-redirect.js")


def install(app: FastAPI) -> None:
    """Mount the assets and the page (create the app with `docs_url=None, redoc_url=None`)."""
    app.mount(ASSETS, _Assets(directory=str(swagger_ui_path)), name="docs-assets")
    redirect = "/docs/oauth2-redirect"

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        page = get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json", title=f"{app.title} - API",
            swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js", swagger_css_url=f"{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS}/favicon-32x32.png", oauth2_redirect_url=redirect,
        )  # fmt: skip
        page.headers["Content-Security-Policy"] = CSP
        return page

    @app.get(redirect, include_in_schema=False)
    async def oauth2_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()


class _Assets(StaticFiles):
    """The bundle's folder, less what the page does not load."""

    def lookup_path(self, path: str) -> tuple[str, object]:  # type: ignore[override]  # Starlette's own is loosely typed
        if path not in _SERVED:
            return "", None  # a 404, as for a missing file
        return super().lookup_path(path)
