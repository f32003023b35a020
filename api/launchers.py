"""`shunter serve`, `api`, `dispatcher`, `db ...`: the commands that start a long-running process or open the database.

Mounted on the root app by `api.cli`; `service` is imported inside each command so the client commands stay light.
"""

from __future__ import annotations

import ipaddress
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from api.console import console, err

if TYPE_CHECKING:
    from collections.abc import Callable

    from service.config.settings import Settings
    from service.runtime import Runtime

app = typer.Typer(help="Run the service.", no_args_is_help=True, add_completion=False)
db_app = typer.Typer(help="Database schema (Alembic migrations).", no_args_is_help=True)
app.add_typer(db_app, name="db")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def where(settings: Settings, dashboard_url: str | None) -> str:
    """The line a server prints once it is up: the API, its web page, and the Ray dashboard."""
    host = settings.host if ":" not in settings.host else f"[{settings.host}]"
    api = f"http://{host}:{settings.port}"
    return f"shunter: API {api}  web page {api}/ui  Ray dashboard {dashboard_url or 'unknown'}"


def _announce(settings: Settings) -> Callable[[Runtime], None]:
    def announce(runtime: Runtime) -> None:
        print(where(settings, getattr(runtime.ray, "dashboard_url", None)), flush=True)

    return announce


def _logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="bind address (default SHUNTER_HOST)")] = None,
    port: Annotated[int | None, typer.Option(help="port (default SHUNTER_PORT)")] = None,
    insecure: Annotated[bool, typer.Option(help="allow a non-loopback bind without API tokens")] = False,
) -> None:
    """Everything on one machine: API + dispatcher + a local Ray head (unless SHUNTER_RAY_ADDRESS) + the database."""
    import uvicorn

    from api.app import create_app

    settings = _http_settings(host, port, insecure)
    application = create_app(
        settings,
        run_dispatcher=True,
        manage_local_ray=True,
        dispatcher_id=settings.resolved_dispatcher_id(stable=True),
        on_ready=_announce(settings),
    )
    uvicorn.run(application, host=settings.host, port=settings.port, log_level="info")


@app.command("api")
def api_server(
    host: Annotated[str | None, typer.Option()] = None,
    port: Annotated[int | None, typer.Option()] = None,
    insecure: Annotated[bool, typer.Option(help="allow a non-loopback bind without API tokens")] = False,
) -> None:
    """The HTTP API alone (run any number), against SHUNTER_DATABASE_URL and SHUNTER_RAY_ADDRESS."""
    import uvicorn

    from api.app import create_app

    settings = _http_settings(host, port, insecure)
    application = create_app(settings, on_ready=_announce(settings))
    uvicorn.run(application, host=settings.host, port=settings.port, log_level="info")


@app.command()
def dispatcher() -> None:
    """A dispatcher loop alone (run any number against one database)."""
    from service.runtime import run_dispatcher_process

    _logging()
    run_dispatcher_process()


def _http_settings(host: str | None, port: int | None, insecure: bool) -> Settings:
    """The settings with the command line's bind address, refusing an open bind without tokens."""
    from service.config.settings import get_settings

    _logging()
    settings = get_settings()
    settings = settings.model_copy(update={"host": host or settings.host, "port": port or settings.port})
    _refuse_open_bind(settings.host, bool(settings.api_tokens), insecure)
    return settings


def _refuse_open_bind(host: str, has_tokens: bool, insecure: bool) -> None:
    if not _is_loopback(host) and not has_tokens and not insecure:
        err.print(
            f"[red]refusing to bind {host} without API tokens[/red]: set SHUNTER_API_TOKENS, "
            "bind 127.0.0.1, or pass --insecure"
        )
        raise typer.Exit(2)


@db_app.command("upgrade")
def db_upgrade(revision: Annotated[str, typer.Argument(help="target revision")] = "head") -> None:
    """Migrate SHUNTER_DATABASE_URL to the newest schema (safe to run from several processes at once)."""
    from service.config.settings import get_settings
    from service.store.db import make_engine
    from service.store.migrate import current, upgrade

    engine = make_engine(get_settings().database_url)
    upgrade(engine, revision)
    console.print(f"database at revision {current(engine)}")


@db_app.command("current")
def db_current() -> None:
    """The schema revision the database is at."""
    from service.config.settings import get_settings
    from service.store.db import make_engine
    from service.store.migrate import current

    console.print(current(make_engine(get_settings().database_url)) or "empty (no shunter schema yet)")


config_app = typer.Typer(help="The service's settings file (SHUNTER_CONFIG).", no_args_is_help=True)


@config_app.command("check")
def config_check(
    file: Annotated[Path, typer.Argument(help="a YAML file of settings, as SHUNTER_CONFIG names it")],
) -> None:
    """Read FILE as the service would (this environment's SHUNTER_* on top of it); each error names its key."""
    import os

    from pydantic import ValidationError

    from service.config import policies
    from service.config.settings import Settings

    os.environ["SHUNTER_CONFIG"] = str(file)
    try:
        settings = Settings()
        policies.check(settings)  # the rules the values configure, as a process builds them when it starts
    except ValidationError as exc:
        for e in exc.errors():
            err.print(f"[red]{'.'.join(str(p) for p in e['loc'])}[/red]: {e['msg']}", soft_wrap=True)
        raise typer.Exit(1) from exc
    except (ValueError, OSError) as exc:  # an unknown key, not a file, not YAML, a policy's mistake
        err.print(f"[red]{escape(str(exc))}[/red]", soft_wrap=True)  # one line each, whatever the terminal's width
        raise typer.Exit(1) from exc
    console.print(f"{file}: ok ({len(settings.model_fields_set)} settings set here or in the environment)")
