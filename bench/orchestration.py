"""Part 1: the same 2-worker DDP job under bare torchrun, a bare Ray Job, and shunter, on one warm Ray head."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench import common
from bench.common import log

POLL_SECONDS = "0.25"  # Ray Train's controller poll, the same for the bare Ray Job and shunter
REPORT_EVERY = 50


def _read(out: Path) -> dict[str, Any]:
    common.wait_for(out.exists, timeout=10, what=str(out))
    return json.loads(out.read_text())


def _row(
    way: str, submit_at: float, done_at: float, summary: dict[str, Any], phases: dict[str, float] | None = None
) -> dict[str, Any]:
    return {
        "way": way,
        "end_to_end_s": done_at - submit_at,
        "submit_to_first_step_s": summary["first_step_at"] - submit_at,
        "step_ms_median": summary["step_ms_median"],
        "step_ms_mean": summary["step_ms_mean"],
        "omp_num_threads": summary["omp_num_threads"],
        "params": summary["params"],
        **({"first_step_phases_s": phases} if phases else {}),
    }


# Submit -> first step of a Ray Job (bare or shunter's), phase by phase, from the timestamps the driver logs
# (`timing: ...`), the train function's own (bench.ddp) and, for shunter, its events. In order; they add up.
PHASES = (
    ("queue and admission", "submitted at", "admitted"),
    ("Ray Job submission", "admitted", "ray_submitted"),
    ("Ray Job supervisor start", "ray_submitted", "process_started"),
    ("driver interpreter and imports", "process_started", "driver_imported"),
    ("driver set-up (spec, ray.init, trainer)", "driver_imported", "fit"),
    ("controller and worker group start", "fit", "worker_started_at"),
    ("worker imports and process group set-up", "worker_started_at", "train_fn_entered_at"),
    ("model set-up (prepare_model, DDP)", "train_fn_entered_at", "model_prepared_at"),
    ("first step", "model_prepared_at", "first_step_at"),
)


def driver_timing(log_text: str) -> dict[str, float]:
    """The last `timing: k=v ...` line of a driver's log (shunter's driver and bench.bare_trainer print one)."""
    found: dict[str, float] = {}
    for line in log_text.splitlines():
        _, sep, rest = line.partition("timing: ")
        if sep and "=" in rest:
            try:
                found = {k: float(v) for k, v in (kv.split("=", 1) for kv in rest.split())}
            except ValueError:
                continue
    return found


def phases_of(marks: dict[str, float]) -> dict[str, float]:
    """Each phase's seconds (a mark missing: the phase merges into the next; a worker process that predates the
    driver's fit() came from Ray's pool: its start counts as fit())."""
    marks = dict(marks)
    if "worker_started_at" in marks and "fit" in marks:
        marks["worker_started_at"] = max(marks["worker_started_at"], marks["fit"])
    out: dict[str, float] = {}
    last = marks.get("submitted at")
    for name, _, end in PHASES:
        if end in marks and last is not None:
            out[name] = max(0.0, marks[end] - last)
            last = marks[end]
    return out


def run_torchrun(steps: int, work: Path) -> dict[str, Any]:
    out = work / f"torchrun-{uuid.uuid4().hex[:6]}.json"
    torchrun = str(Path(sys.executable).parent / "torchrun")
    cmd = [torchrun, "--nproc_per_node=2", str(common.ROOT / "bench" / "ddp_torchrun.py"), "--steps", str(steps),
           "--out", str(out)]  # fmt: skip
    submit_at = time.time()
    proc = common.spawn(cmd, env=common.base_env(OMP_NUM_THREADS="1"), log_path=work / "torchrun.log")
    rc = proc.wait(timeout=300)
    done_at = time.time()
    common.stop(proc)
    if rc != 0:
        raise RuntimeError(f"torchrun exited {rc}; see {work / 'torchrun.log'}")
    return _row("torchrun", submit_at, done_at, _read(out))


def run_bare_ray_job(steps: int, work: Path, head: Any) -> dict[str, Any]:
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(head.dashboard_url)
    out = work / f"bare-{uuid.uuid4().hex[:6]}.json"
    entry = f"python -m bench.bare_trainer --steps {steps} --report-every {REPORT_EVERY} --out {out}"
    env = {"OMP_NUM_THREADS": "1", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": POLL_SECONDS}
    submit_at = time.time()
    sub_id = client.submit_job(entrypoint=entry, runtime_env={"env_vars": env})
    accepted_at = time.time()
    terminal = {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}
    status = common.wait_for(
        lambda: (s := client.get_job_status(sub_id)) in terminal and s, timeout=300, interval=0.1, what=sub_id
    )
    done_at = time.time()
    if status != JobStatus.SUCCEEDED:
        raise RuntimeError(f"bare Ray Job {sub_id}: {status}: {client.get_job_logs(sub_id)[-3000:]}")
    logs = client.get_job_logs(sub_id)
    client.delete_job(sub_id)
    summary = _read(out)
    marks = {"submitted at": submit_at, "admitted": submit_at, "ray_submitted": accepted_at, **driver_timing(logs),
             **summary}  # fmt: skip
    return _row("bare Ray Job", submit_at, done_at, summary, phases_of(marks))


def start_service(head: Any, work: Path, **extra: str) -> tuple[Any, str]:
    from service.backends.ray_local import free_port

    port = free_port()
    data = work / f"serve-{uuid.uuid4().hex[:6]}"
    data.mkdir(parents=True)
    settings = {
        "SHUNTER_DATABASE_URL": f"sqlite:///{data / 'shunter.db'}",
        "SHUNTER_DATA_DIR": str(data),
        "SHUNTER_STORAGE_URI": str(data / "checkpoints"),
        "SHUNTER_RAY_ADDRESS": head.gcs_address,
        "SHUNTER_RAY_DASHBOARD_URL": head.dashboard_url,
        "SHUNTER_PORT": str(port),
        "SHUNTER_DISPATCHER_TICK_SECONDS": "0.25",
        "SHUNTER_TRAIN_POLL_SECONDS": POLL_SECONDS,
        "SHUNTER_STOP_RAY_ON_EXIT": "false",
    }
    env = common.base_env(**{**settings, **extra})
    proc = common.spawn(common.shunter_cmd("serve"), env=env, log_path=data / "serve.log")
    url = f"http://127.0.0.1:{port}"
    common.wait_http(f"{url}/readyz", timeout=90, proc=proc)
    return proc, url


def shunter_spec(steps: int, out: Path, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "entrypoint": {"callable": "bench.ddp:train_loop"},
        "resources": {"num_workers": 2, "resources_per_worker": {"CPU": 1}},
        "config": {"total_steps": steps, "report_every": REPORT_EVERY, "out": str(out)},
    }


def run_shunter(steps: int, work: Path, url: str) -> dict[str, Any]:
    from api.client import Client

    out = work / f"shunter-{uuid.uuid4().hex[:6]}.json"
    with Client(url) as client:
        submit_at = time.time()
        job = client.submit(shunter_spec(steps, out, "bench-ddp"))
        final = client.wait(job.id, timeout=300, interval=0.1)
        done_at = time.time()
        if final.state != "SUCCEEDED":
            raise RuntimeError(f"shunter job {job.id}: {final.state}: {final.last_error}")
        events = client.events(job.id)
        logs = client.logs(job.id)
    marks: dict[str, float] = {"submitted at": submit_at}
    for event in events:
        if event.to_state == "STARTING":
            marks.setdefault("admitted", event.at.timestamp())
        if event.reason == "ray_job_submitted":
            marks.setdefault("ray_submitted", event.at.timestamp())
    summary = _read(out)
    return _row("shunter", submit_at, done_at, summary, phases_of({**marks, **driver_timing(logs), **summary}))


def run(quick: bool) -> dict[str, Any]:
    steps, reps = (100, 1) if quick else (300, 2)
    head = common.ray_head()
    work = Path(tempfile.mkdtemp(prefix="shunter-bench-orch-"))
    proc, url = start_service(head, work)
    rows: list[dict[str, Any]] = []
    try:
        # A warm-up Ray Job: the first job on a fresh head pays for worker-pool start and cold imports.
        log("part 1: warm-up Ray Job")
        run_bare_ray_job(20, work, head)
        for rep in range(reps):
            for fn in (lambda: run_torchrun(steps, work), lambda: run_bare_ray_job(steps, work, head),
                       lambda: run_shunter(steps, work, url)):  # fmt: skip
                row = fn()
                row["rep"] = rep
                rows.append(row)
                log(f"part 1: {row['way']}: e2e {row['end_to_end_s']:.1f}s, first step "
                    f"{row['submit_to_first_step_s']:.1f}s, {row['step_ms_median']:.2f} ms/step")  # fmt: skip
    finally:
        common.stop(proc, grace=20)

    def med(way: str, key: str) -> float:
        return common.median([r[key] for r in rows if r["way"] == way])

    summary = {}
    for way in ("torchrun", "bare Ray Job", "shunter"):
        summary[way] = {k: med(way, k) for k in ("end_to_end_s", "submit_to_first_step_s", "step_ms_median")}
    for way in ("bare Ray Job", "shunter"):
        runs = [r["first_step_phases_s"] for r in rows if r["way"] == way and r.get("first_step_phases_s")]
        summary[way]["first_step_phases_s"] = {name: common.median([p.get(name, 0.0) for p in runs])
                                               for name, _, _ in PHASES if any(name in p for p in runs)}  # fmt: skip
    _print_phases(summary)
    ratios = {}
    for key in ("end_to_end_s", "submit_to_first_step_s", "step_ms_median"):
        ratios[f"shunter/torchrun {key}"] = summary["shunter"][key] / summary["torchrun"][key]
        ratios[f"shunter/bare Ray Job {key}"] = summary["shunter"][key] / summary["bare Ray Job"][key]
        ratios[f"bare Ray Job/torchrun {key}"] = summary["bare Ray Job"][key] / summary["torchrun"][key]
    return {
        "steps": steps,
        "reps": reps,
        "report_every": REPORT_EVERY,
        "train_poll_seconds": float(POLL_SECONDS),
        "params": rows[0]["params"] if rows else None,
        "runs": rows,
        "median": summary,
        "ratios": ratios,
        "targets": {
            "per_step <= 1.02x torchrun": ratios["shunter/torchrun step_ms_median"] <= 1.02,
            "end_to_end <= 1.0x bare Ray Job": ratios["shunter/bare Ray Job end_to_end_s"] <= 1.0,
            "submit->first step < bare Ray Job": ratios["shunter/bare Ray Job submit_to_first_step_s"] < 1.0,
        },
    }


def _print_phases(summary: dict[str, Any]) -> None:
    bare = summary["bare Ray Job"].get("first_step_phases_s") or {}
    ours = summary["shunter"].get("first_step_phases_s") or {}
    log("part 1: submit -> first step, phase by phase (median seconds): bare Ray Job | shunter")
    for name, _, _ in PHASES:
        if name in bare or name in ours:
            log(f"  {name:<44} {bare.get(name, 0.0):6.2f} | {ours.get(name, 0.0):6.2f}")
    log(f"  {'sum':<44} {sum(bare.values()):6.2f} | {sum(ours.values()):6.2f}")


if __name__ == "__main__":  # pragma: no cover - ad hoc
    os.chdir(common.ROOT)
    try:
        print(json.dumps(run(quick=True), indent=1))
    finally:
        common.stop_all()
        common.close_ray_head()
