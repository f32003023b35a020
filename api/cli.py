"""`shunter`: run the service (`serve`, `api`, `dispatcher`, `db`) and talk to it (`submit`, `status`, `watch`, ...).

The root app only mounts the two halves: `api.launchers` (commands that start a process or open the database) and
`api.commands` and `api.report_commands` (plain clients of the REST API through `api.client`; they work against any
shunter server).
This module stays the entry point: the `shunter` console script and `python -m api.cli`.
"""

from __future__ import annotations

from typing import Annotated

import typer

from api import commands, launchers, profiles, report_commands, secret_commands, sweep_commands

# Completion for bash, zsh and fish: `shunter --install-completion`, or `--show-completion <shell>` to print it.
app = typer.Typer(help="shunter: a durable queue in front of Ray Train.", no_args_is_help=True)


@app.callback()
def main(
    profile: Annotated[
        str | None,
        typer.Option(
            "--profile",
            "-p",
            envvar="SHUNTER_PROFILE",
            help="server and token from this profile of ~/.config/shunter/config.toml",
        ),
    ] = None,
) -> None:
    """shunter: a durable queue in front of Ray Train."""
    profiles.selected = profile


# Copy the commands (and the `db` group) onto the root rather than `app.add_typer(part)`: merging a nameless
# sub-app needs typer >= 0.15, and pyproject allows 0.12. Launchers first, so `--help` lists them first.
for part in (launchers.app, commands.app, report_commands.app):
    app.registered_commands.extend(part.registered_commands)
    app.registered_groups.extend(part.registered_groups)
app.add_typer(sweep_commands.app, name="sweep")  # a named group: fine on typer 0.12
app.add_typer(secret_commands.app, name="secret")
app.add_typer(launchers.config_app, name="config")


if __name__ == "__main__":
    app()
