"""What the CLI's client commands share: the options every one takes, the client (with the profile's server and
token, `api.profiles`), and how a failure or `--json` is printed."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any, NoReturn

import httpx
import typer
import yaml
from pydantic import BaseModel
from rich.markup import escape

from api import profiles
from api.client import ApiError, Client
from api.console import console, err

ServerOpt = Annotated[str, typer.Option("--server", "-s", envvar="SHUNTER_URL", help="shunter API base URL")]
TokenOpt = Annotated[str | None, typer.Option("--token", envvar="SHUNTER_TOKEN", help="API bearer token")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON for scripts")]
DEFAULT_URL = "http://127.0.0.1:8080"


def _client(server: str, token: str | None) -> Client:
    """A client of `server` with `token`; what neither the flags nor SHUNTER_URL / SHUNTER_TOKEN gave comes from the
    profile (`api.profiles`)."""
    try:
        profile = profiles.load()
    except profiles.ProfileError as exc:
        err.print(f"[red]{escape(str(exc))}[/red]")
        raise typer.Exit(2) from exc
    if server == DEFAULT_URL and profile.server:
        server = profile.server
    return Client(server, token=token if token is not None else profile.token)


@contextlib.contextmanager
def _calling(server: str, token: str | None) -> Iterator[Client]:
    """A client whose API errors end the command with the server's message (exit 1 for 4xx, 2 otherwise)."""
    with _client(server, token) as c:
        try:
            yield c
        except ApiError as exc:
            _fail(exc)
        except httpx.HTTPError as exc:
            _fail(RuntimeError(f"cannot reach the shunter API at {server}: {exc}"))


def _fail(exc: Exception) -> NoReturn:
    """End the command with the error: an API answer's fields first (a spec's 422 names each), then its message."""
    for e in (exc.body.get("errors") or []) if isinstance(exc, ApiError) else []:
        err.print(f"[red]{escape(str(e['field']))}[/red]: {escape(str(e['message']))}")
    err.print(f"[red]error:[/red] {escape(str(exc))}")
    raise typer.Exit(1 if isinstance(exc, ApiError) and exc.status_code < 500 else 2)


def _print_json(data: BaseModel | Sequence[BaseModel]) -> None:
    """`--json`: one model as its JSON object, a list of them as a JSON array."""
    if isinstance(data, BaseModel):
        console.print_json(data.model_dump_json())
    else:
        console.print_json(json.dumps([r.model_dump(mode="json") for r in data]))


def _load_spec(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        err.print(f"[red]cannot read {escape(str(path))}:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from exc
    if not isinstance(data, dict):
        err.print(f"[red]{escape(str(path))} is not a job spec (a mapping)[/red]")
        raise typer.Exit(2)
    return data
