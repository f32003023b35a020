"""`shunter secret set | list | delete`: clients of /v1/secrets (mounted by `api.cli` as `secret`).

A value is read from standard input or a prompt, never from the command line, where it would land in the shell's
history and every user's `ps`."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from api.cli_common import DEFAULT_URL, JsonOpt, ServerOpt, TokenOpt, _calling
from api.console import console

app = typer.Typer(help="Secrets jobs name in `secrets:` (values are never shown).", no_args_is_help=True,
                  add_completion=False)  # fmt: skip
ScopeOpt = Annotated[str, typer.Option("--scope", help="owner (yours), team or cluster (admins)")]
TeamOpt = Annotated[str | None, typer.Option("--team", help="the team, for --scope team")]
OwnerOpt = Annotated[str | None, typer.Option("--owner", help="another owner's (admins)")]


def _holder(team: str | None, owner: str | None) -> dict[str, str]:
    return {k: v for k, v in (("team", team), ("owner", owner)) if v}


@app.command("set")
def set_(
    name: Annotated[str, typer.Argument(help="an environment variable's name, e.g. HF_TOKEN")],
    scope: ScopeOpt = "owner",
    team: TeamOpt = None,
    owner: OwnerOpt = None,
    server: ServerOpt = DEFAULT_URL,
    token: TokenOpt = None,
) -> None:
    """Keep a secret's value, read from standard input (or a prompt at a terminal); replaces one of that name."""
    if sys.stdin.isatty():
        value = typer.prompt(f"value of {name}", hide_input=True)
    else:
        value = sys.stdin.read().removesuffix("\n")
    if not value:
        raise typer.BadParameter("the value is empty", param_hint="standard input")
    with _calling(server, token) as c:
        kept = c.put_secret(name, value, scope=scope, **_holder(team, owner))
    holder = kept.owner or kept.team or "the cluster"
    console.print(f"kept secret [bold]{escape(kept.name)}[/bold] for {escape(holder)} ({kept.scope})")


@app.command("list")
def list_(server: ServerOpt = DEFAULT_URL, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """The secrets your jobs may name: yours, your team's and the cluster's (an admin: all). Names only."""
    with _calling(server, token) as c:
        kept = c.secrets()
    if as_json:
        console.print_json(json.dumps([s.model_dump(mode="json") for s in kept]))
        return
    table = Table("name", "scope", "of", "updated", "by")
    for s in kept:
        table.add_row(escape(s.name), s.scope, escape(s.owner or s.team or "-"),
                      s.updated_at.isoformat(timespec="seconds"), escape(s.updated_by))  # fmt: skip
    console.print(table)


@app.command()
def delete(
    name: str, scope: ScopeOpt = "owner", team: TeamOpt = None, owner: OwnerOpt = None,
    server: ServerOpt = DEFAULT_URL, token: TokenOpt = None,
) -> None:  # fmt: skip
    """Forget a secret. Jobs naming it that have not started fail their attempt (user error)."""
    with _calling(server, token) as c:
        c.delete_secret(name, scope=scope, **_holder(team, owner))
    console.print(f"deleted secret {escape(name)}")
