"""`shunter cluster` and `shunter usage`: what the cluster holds and what each owner, team and queue used, as
tables (or `--json`). Plain clients of the REST API, as `api.commands` are; mounted on the root CLI by `api.cli`."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Column, Table

from api.cli_common import DEFAULT_URL, JsonOpt, ServerOpt, TokenOpt, _calling, _print_json
from api.console import console
from api.schemas import UsagePublic

app = typer.Typer(help="What the cluster holds, and who used it.", no_args_is_help=True, add_completion=False)


@app.command()
def cluster(server: ServerOpt = DEFAULT_URL, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """The Ray cluster as the dispatcher last saw it: nodes, free resources, dashboard, running jobs."""
    with _calling(server, token) as c:
        view = c.cluster()
    if as_json:
        _print_json(view)
        return
    console.print(escape(f"dashboard: {view.dashboard_url or '?'}   seen: {view.taken_at or 'never'}"))
    table = Table("node", "address", "alive", "CPU free/total", "GPU free/total")
    for n in view.nodes:
        cells = [f"{n.available.get(k, 0):g}/{n.total.get(k, 0):g}" for k in ("CPU", "GPU")]
        table.add_row(escape(n.node_id[:12]), escape(n.address or ""), "yes" if n.alive else "no", *cells)
    console.print(table)
    for j in view.jobs:
        console.print(
            escape(f"{j.id} {j.name} {j.state} attempt {j.attempt} {j.resources} {j.ray_dashboard_url or ''}")
        )


@app.command()
def usage(
    owner: Annotated[str | None, typer.Option(help="one owner (admins; others always see their own)")] = None,
    team: Annotated[str | None, typer.Option(help="one team")] = None,
    queue: Annotated[str | None, typer.Option(help="one queue")] = None,
    since: Annotated[str | None, typer.Option(help="start, ISO-8601 (no zone: UTC); default: a week back")] = None,
    until: Annotated[str | None, typer.Option(help="end, ISO-8601 (no zone: UTC); default: now")] = None,
    server: ServerOpt = DEFAULT_URL,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """CPU- and GPU-hours by owner, team and queue; jobs ended by state; queue-wait percentiles."""
    with _calling(server, token) as c:
        report = c.usage(owner=owner, team=team, queue=queue, since=since, until=until)
    if as_json:
        _print_json(report)
        return
    numbers = [Column(name, justify="right") for name in ("CPU-h", "GPU-h", "attempts")]
    title = f"usage {report.since:%Y-%m-%d %H:%M} to {report.until:%Y-%m-%d %H:%M} UTC"
    table = Table("owner", "team", "queue", *numbers, title=title)
    for r in report.rows:
        table.add_row(
            escape(r.owner),
            escape(r.team or ""),
            escape(r.queue),
            f"{r.cpu_hours:.2f}",
            f"{r.gpu_hours:.2f}",
            str(r.attempts),
        )
    t = report.totals
    table.add_section()
    table.add_row("[bold]total[/bold]", "", "", f"{t.cpu_hours:.2f}", f"{t.gpu_hours:.2f}", str(t.attempts))
    console.print(table)
    console.print("jobs ended: " + "  ".join(f"{state} {n}" for state, n in report.jobs_ended.items()))
    console.print(_wait_line(report))


def _wait_line(report: UsagePublic) -> str:
    w = report.queue_wait
    if not w.jobs:
        return "queue wait: no job started in the window"
    cells = "  ".join(f"{name} {value:.0f}s" for name, value in (("p50", w.p50), ("p90", w.p90), ("p99", w.p99)))
    return f"queue wait ({w.jobs} jobs): {cells}"
