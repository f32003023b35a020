"""`shunter submit`, `status`, `list`, `watch`, ...: clients of the REST API (`api.client`), for any shunter server.

Mounted on the root app by `api.cli`. The helpers every command shares live here once: `_calling` (an API error ends
the command with the server's message and exit code 1 for 4xx, 2 otherwise), `_print_json` (the `--json` output) and
the rich progress display of `watch`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from api import spec_overrides
from api.cli_common import (
    DEFAULT_URL,
    JsonOpt,
    ServerOpt,
    TokenOpt,
    _calling,
    _fail,
    _load_spec,
    _print_json,
)  # fmt: skip
from api.client import TERMINAL, working_dir_excludes, zipped
from api.console import console, err
from api.schemas import EventPublic

app = typer.Typer(help="Talk to a shunter server.", no_args_is_help=True, add_completion=False)

STATUS_FIELDS = (
    "id", "name", "state", "state_reason", "position", "estimated_start", "attempt", "step", "loss",
    "latest_checkpoint", "end_reason", "last_error", "created_at", "started_at", "finished_at", "ray_submission_id",
    "ray_dashboard_url",
)  # fmt: skip


@app.command()
def submit(
    file: Annotated[Path, typer.Argument(help="job spec, YAML or JSON")],
    server: ServerOpt = DEFAULT_URL,
    token: TokenOpt = None,
    idempotency_key: Annotated[str | None, typer.Option("--idempotency-key")] = None,
    watch_it: Annotated[bool, typer.Option("--watch", "-w", help="then watch it to the end")] = False,
    as_json: JsonOpt = False,
    working_dir: Annotated[
        Path | None,
        typer.Option("--working-dir", help="zip this folder, upload it (POST /v1/code), run the job in it"),
    ] = None,
    env: Annotated[
        list[str] | None, typer.Option("--env", help="NAME=value into runtime_env.env_vars (repeat)")
    ] = None,
    sets: Annotated[list[str] | None, typer.Option("--set", help="a.b=value: set a field (YAML value; repeat)")] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="run every check a submission runs; queue nothing")
    ] = False,
) -> None:
    """Queue a job; prints its id."""
    try:
        spec = spec_overrides.apply(_load_spec(file), env=env, sets=sets)
    except spec_overrides.OverrideError as exc:
        err.print(f"[red]{escape(str(exc))}[/red]")
        raise typer.Exit(2) from exc
    if dry_run:
        _dry_run(spec, working_dir, server=server, token=token, as_json=as_json)
        return
    with _calling(server, token) as c:
        try:
            if working_dir is None:
                job = c.submit(spec, idempotency_key=idempotency_key)
            else:
                job = c.submit_with_working_dir(spec, working_dir, idempotency_key=idempotency_key)
        except OSError as exc:  # --working-dir: not a folder, unreadable
            _fail(exc)
    if as_json:
        _print_json(job)
    else:
        console.print(f"submitted [bold]{job.id}[/bold] ({escape(job.name)}) state={job.state}")
    if watch_it:
        watch(job.id, server=server, token=token)


def _dry_run(spec: dict[str, Any], working_dir: Path | None, *, server: str, token: str | None, as_json: bool) -> None:
    """`submit --dry-run`: the server's checks (`POST /v1/jobs/validate`); a working dir is zipped here, not uploaded
    (what it would hold is counted), and the spec is checked without it."""
    files = None
    if working_dir is not None:
        try:
            _, files = zipped(working_dir, excludes=working_dir_excludes(spec))
        except OSError as exc:
            _fail(exc)
    with _calling(server, token) as c:
        said = c.validate(spec)
    if as_json:
        _print_json(said.model_copy(update={"spec": said.spec | ({"working_dir_files": files} if files else {})}))
        return
    console.print("[green]valid[/green]: a submission would be queued (nothing was)")
    if files is not None:
        console.print(f"--working-dir would upload {files} files")
    if said.state_reason and said.state_reason != "waiting for resources":
        console.print(f"it would wait: {escape(said.state_reason)}")
    for warning in said.warnings:
        console.print(f"[yellow]warning[/yellow]: {escape(warning)}")


@app.command()
def status(job_id: str, server: ServerOpt = DEFAULT_URL, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """One job: state, attempt, step, loss, checkpoint, error."""
    with _calling(server, token) as c:
        job = c.get(job_id)
        attempts = c.attempts(job_id) if job.attempt and not as_json else []
    if as_json:
        _print_json(job)
        return
    table = Table(show_header=False, box=None)
    table.add_column(no_wrap=True)
    table.add_column(overflow="fold")  # paths and URLs are for copying: fold them, never cut them
    for key in STATUS_FIELDS:
        value = getattr(job, key)
        if key == "position" and value is not None:
            value = f"{value.queue} in queue {job.queue!r}, {value.overall} overall"
        elif key == "estimated_start" and job.state == "QUEUED":
            value = _start_text(value) if not job.waiting_on else "once its dependencies are met"
        if value is not None:
            table.add_row(f"[bold]{key}[/bold]", escape(str(value)))
    current = next((a for a in attempts if a.number == job.attempt), None)
    from service.lifecycle import preflight_results  # here: it imports the database layer, which no other command needs

    checked = preflight_results.summary(current.preflight) if current is not None else None
    if checked:
        table.add_row("[bold]preflight[/bold]", escape(f"attempt {job.attempt}: {checked}"))
    for dep in job.dependencies or []:  # depends_on (service.workflows.dependencies)
        named = f", as {dep.as_}" if dep.as_ else ""
        handed = f", checkpoint {dep.checkpoint}" if dep.checkpoint else ""
        table.add_row(
            "[bold]depends on[/bold]", escape(f"{dep.job} (on {dep.on}{named}): {dep.status}, {dep.state}{handed}")
        )
    console.print(table)


def _start_text(start: Any) -> str:
    """An estimated start as a local time and a wait ("not known" when a job ahead has no timeout)."""
    if start is None:
        return "not known (a job ahead has no timeout_seconds or total_steps)"
    wait = max(0.0, start.timestamp() - time.time())
    return f"{start.astimezone():%Y-%m-%d %H:%M:%S} (in {wait / 60:.0f} min)" if wait >= 60 else "within a minute"


def _queued_text(job: Any) -> str:
    """`watch`'s state column while a job waits: its place and expected start."""
    if job.state != "QUEUED" or job.position is None:
        return job.state
    return f"QUEUED #{job.position.queue} in {job.queue}, start {_start_text(job.estimated_start)}"


@app.command("list")
def list_cmd(
    state: Annotated[str | None, typer.Option(help="only jobs in this state")] = None,
    queue: Annotated[str | None, typer.Option(help="only this queue's jobs")] = None,
    owner: Annotated[str | None, typer.Option(help="admins: only this owner's jobs")] = None,
    name: Annotated[str | None, typer.Option(help="only jobs of this name")] = None,
    sweep: Annotated[str | None, typer.Option(help="only this sweep's members")] = None,
    limit: Annotated[int, typer.Option(help="jobs a page")] = 50,
    cursor: Annotated[str | None, typer.Option(help="the page after the one that printed it")] = None,
    server: ServerOpt = DEFAULT_URL,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Jobs, newest first, a page at a time (the next page's --cursor is printed under it)."""
    with _calling(server, token) as c:
        page = c.list(state=state.upper() if state else None, limit=limit, cursor=cursor, queue=queue or "",
                      owner=owner or "", name=name or "", sweep=sweep or "")  # fmt: skip
    if as_json:
        _print_json(page)
        return
    table = Table("id", "name", "state", "attempt", "step", "loss", "created")
    table.columns[0].no_wrap = True  # ids are for copying: never fold them
    for job in page.items:
        loss = f"{job.loss:.4f}" if job.loss is not None else ""
        table.add_row(job.id, escape(job.name), job.state, str(job.attempt), str(job.step or ""), loss,
                      job.created_at.strftime("%Y-%m-%d %H:%M:%S"))  # fmt: skip
    console.print(table)
    if page.next_cursor:
        console.print(f"more: --cursor {escape(page.next_cursor)}")


@app.command()
def cancel(job_id: str, server: ServerOpt = DEFAULT_URL, token: TokenOpt = None) -> None:
    """Cancel a job (its Ray Job is stopped)."""
    with _calling(server, token) as c:
        body = c.cancel(job_id)
    console.print(escape(f"{job_id}: {body['detail']} (state {body['state']})"))


@app.command()
def retry(job_id: str, server: ServerOpt = DEFAULT_URL, token: TokenOpt = None) -> None:
    """Queue a FAILED or CANCELLED job again, resuming from its last good checkpoint."""
    with _calling(server, token) as c:
        body = c.retry(job_id)
    console.print(escape(f"{job_id}: {body['detail']} (state {body['state']})"))


@app.command()
def logs(
    job_id: str,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="stream until the job ends")] = False,
    attempt: Annotated[int | None, typer.Option(help="which attempt (default: the latest)")] = None,
    tail: Annotated[int | None, typer.Option("--tail", "-n", min=1, help="only the last N lines")] = None,
    server: ServerOpt = DEFAULT_URL,
    token: TokenOpt = None,
) -> None:
    """The job's driver and worker output."""
    with _calling(server, token) as c:
        if follow:
            for chunk in c.follow_logs(job_id, attempt=attempt, tail=tail):
                sys.stdout.write(chunk)
                sys.stdout.flush()
        else:
            sys.stdout.write(c.logs(job_id, attempt=attempt, tail=tail))


def _event_row(table: Table, e: EventPublic) -> None:
    change = f"{e.from_state or ''} → {e.to_state}" if e.to_state else ""
    table.add_row(e.at.strftime("%H:%M:%S.%f")[:-3], e.kind, change, escape(e.reason), escape((e.message or "")[:80]))


@app.command()
def events(
    job_id: Annotated[str | None, typer.Argument(help="a job id; without it, every job you may see")] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="stream as they happen (SSE)")] = False,
    server: ServerOpt = DEFAULT_URL,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The timeline: every state change, Ray submission, checkpoint and retry decision, with time and reason.

    With --follow a job's stream ends after its terminal event; with --json, one JSON object per line.
    """
    with _calling(server, token) as c:
        if follow:
            for e in c.stream_events(job_id):
                if as_json:
                    print(e.model_dump_json(), flush=True)
                else:
                    change = f" {e.from_state or '·'} → {e.to_state}" if e.to_state else ""
                    job = "" if job_id else f"{e.job_id} "
                    console.print(escape(f"{e.at:%H:%M:%S} {job}{e.kind}{change} ({e.reason}) {e.message or ''}"))
            return
        rows = c.events(job_id) if job_id else c.all_events(limit=1000)
    if as_json:
        _print_json(rows)
        return
    table = Table("time", "kind", "change", "reason", "message")
    for e in rows:
        _event_row(table, e)
    console.print(table)


@app.command()
def metrics(
    job_id: str,
    name: Annotated[str | None, typer.Option("--name", "-n", help="one metric, e.g. loss")] = None,
    server: ServerOpt = DEFAULT_URL,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Reported metrics of a job (every ray.train.report value), by step."""
    with _calling(server, token) as c:
        points = c.metrics(job_id, name=name)
    if as_json:
        _print_json(points)
        return
    names = sorted({p.name for p in points})
    by_step: dict[tuple[int, int | None], dict[str, float]] = {}
    for p in points:
        by_step.setdefault((p.attempt, p.step), {})[p.name] = p.value
    table = Table("attempt", "step", *map(escape, names))
    for (number, step), values in by_step.items():
        table.add_row(str(number), str(step if step is not None else ""), *(_num(values.get(n)) for n in names))
    console.print(table)


def _num(value: float | None) -> str:
    return "" if value is None else f"{value:.6g}"


@app.command()
def checkpoints(job_id: str, server: ServerOpt = DEFAULT_URL, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """A job's checkpoints: attempt, step, metrics, where it lies, complete / pruned."""
    with _calling(server, token) as c:
        rows = c.checkpoints(job_id)
    if as_json:
        _print_json(rows)
        return
    table = Table("id", "attempt", "step", "loss", "state", "created", "uri")
    table.columns[-1].overflow = "fold"  # paths are for copying: fold them, never cut them
    for k in rows:
        state = "pruned" if k.pruned else ("complete" if k.complete else "incomplete")
        loss = _num((k.metrics or {}).get("loss"))
        table.add_row(
            str(k.id), str(k.attempt), str(k.step or ""), loss, state, f"{k.created_at:%H:%M:%S}", escape(k.uri)
        )
    console.print(table)


@app.command()
def watch(job_id: str, server: ServerOpt = DEFAULT_URL, token: TokenOpt = None) -> None:
    """Follow a job to its end with a progress bar (step / total, loss, ETA) and its state changes."""
    with _calling(server, token) as c:
        job = c.get(job_id)
        config = (job.spec or {}).get("config", {})  # (GET /v1/jobs/{id} always has the spec)
        total = config.get("total_steps") or config.get("steps")
        seen_events = 0
        columns = [TextColumn("[bold]{task.fields[state]}"), BarColumn(), TextColumn("step {task.completed:.0f}"),
                   TextColumn("{task.fields[loss]}"), TimeElapsedColumn(), TimeRemainingColumn()]  # fmt: skip
        with Progress(*columns, console=console) as progress:
            task = progress.add_task(job.name, total=total, state=job.state, loss="")
            while True:
                job = c.get(job_id)
                for e in c.events(job_id, after=seen_events):
                    seen_events = e.id
                    if e.to_state:
                        progress.console.print(
                            escape(f"{e.at:%H:%M:%S} {e.from_state or '·'} → {e.to_state} ({e.reason})")
                        )
                loss = f"loss {job.loss:.4f}" if job.loss is not None else ""
                total = total or (job.latest_metrics or {}).get("total_steps")
                progress.update(task, total=total, completed=job.step or 0, state=escape(_queued_text(job)), loss=loss)
                if job.state in TERMINAL:
                    break
                time.sleep(0.5)
    style = "green" if job.state == "SUCCEEDED" else "red"
    console.print(f"[{style}]{job.id} {job.state}[/{style}]" + escape(f": {job.last_error}" if job.last_error else ""))
    if job.latest_checkpoint:
        console.print(escape(f"latest checkpoint: {job.latest_checkpoint}"))
    if job.state != "SUCCEEDED":
        raise typer.Exit(1)
