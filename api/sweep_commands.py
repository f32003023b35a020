"""`shunter sweep submit | status | list | cancel`: clients of /v1/sweeps (mounted by `api.cli` as `sweep`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from api.cli_common import DEFAULT_URL, JsonOpt, ServerOpt, TokenOpt, _calling, _load_spec, _print_json
from api.console import console
from api.sweep_schemas import SweepMember, SweepPublic

app = typer.Typer(help="Sweeps and arrays: many jobs from one base spec.", no_args_is_help=True, add_completion=False)


@app.command()
def submit(
    file: Annotated[Path, typer.Argument(help="sweep request, YAML or JSON: base, grid / points / count, ...")],
    server: ServerOpt = DEFAULT_URL,
    token: TokenOpt = None,
    idempotency_key: Annotated[str | None, typer.Option("--idempotency-key")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Queue every member of a sweep; prints the sweep's id."""
    request = _load_spec(file)
    with _calling(server, token) as c:
        sweep = c.submit_sweep(request, idempotency_key=idempotency_key)
    if as_json:
        _print_json(sweep)
        return
    limit = f", at most {sweep.max_parallel} at once" if sweep.max_parallel else ""
    console.print(f"submitted sweep [bold]{sweep.id}[/bold] ({sweep.name}): {sweep.size} members{limit}")


def ranked(sweep: SweepPublic) -> list[SweepMember]:
    """Members best first (by rank), then those that have not reported the metric, by index."""
    return sorted(sweep.members, key=lambda m: (m.rank is None, m.rank or 0, m.index))


def _values(values: dict[str, Any]) -> str:
    return " ".join(f"{k}={json.dumps(v)}" for k, v in values.items())


@app.command()
def status(sweep_id: str, server: ServerOpt = DEFAULT_URL, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """A sweep's members ranked by its metric, best first: rank, index, job, state, metric, values."""
    with _calling(server, token) as c:
        sweep = c.sweep(sweep_id)
    if as_json:
        _print_json(sweep)
        return
    metric = f"{sweep.metric.name} ({sweep.metric.mode})" if sweep.metric else "no metric"
    counts = "  ".join(f"{state} {n}" for state, n in sorted(sweep.counts.items()))
    console.print(f"sweep [bold]{sweep.id}[/bold] {sweep.name}: {sweep.size} members, {metric}; {counts}")
    name = sweep.metric.name if sweep.metric else "metric"
    table = Table("rank", "index", "job", "state", name, f"best {name}", "values")
    table.columns[2].no_wrap = True  # ids are for copying
    for m in ranked(sweep):
        table.add_row(str(m.rank or ""), str(m.index), m.job_id, m.state, _num(m.metric), _num(m.best_metric),
                      _values(m.values))  # fmt: skip
    console.print(table)
    if sweep.best is not None:
        b = sweep.best
        console.print(f"best: member {b.index} ({b.job_id}) {name}={_num(b.metric)} {_values(b.values)}")


def _num(value: float | None) -> str:
    return "" if value is None else f"{value:.6g}"


@app.command("list")
def list_cmd(server: ServerOpt = DEFAULT_URL, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """Your sweeps, newest first, with their members' counts by state."""
    with _calling(server, token) as c:
        page = c.sweeps()
    if as_json:
        _print_json(page)
        return
    table = Table("id", "name", "members", "states", "created")
    table.columns[0].no_wrap = True
    for s in page.items:
        states = " ".join(f"{k}:{v}" for k, v in sorted(s.counts.items()))
        table.add_row(s.id, s.name, str(s.size), states, f"{s.created_at:%Y-%m-%d %H:%M:%S}")
    console.print(table)


@app.command()
def cancel(sweep_id: str, server: ServerOpt = DEFAULT_URL, token: TokenOpt = None) -> None:
    """Cancel every member of a sweep that has not ended."""
    with _calling(server, token) as c:
        body = c.cancel_sweep(sweep_id)
    console.print(f"{sweep_id}: {body.detail}")
