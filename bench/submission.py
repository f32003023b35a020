"""Part 2: POST /v1/jobs on SQLite and PostgreSQL vs a bare FastAPI endpoint (same uvicorn, same load generator)
and vs Ray Jobs `submit_job` on the local head."""

from __future__ import annotations

import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench import common
from bench.common import log
from bench.loadgen import post_load

SPEC = {
    "name": "bench-submit",
    "entrypoint": {"callable": "examples.mlp:train_loop"},
    "resources": {"num_workers": 2},
    "config": {"total_steps": 10},
}


def _serve(cmd: list[str], env: dict[str, str], port: int, log_path: Path) -> Any:
    proc = common.spawn(cmd, env=env, log_path=log_path)
    common.wait_http(f"http://127.0.0.1:{port}/readyz", timeout=60, proc=proc)
    return proc


def _load(name: str, url: str, quick: bool) -> dict[str, Any]:
    n, n1 = (400, 100) if quick else (2000, 300)
    out = {
        "c16": post_load(url, SPEC, total=n, concurrency=16),
        "c1": post_load(url, SPEC, total=n1, concurrency=1),
    }
    log(f"part 2: {name}: {out['c16']['per_s']:.0f}/s at 16 clients (p50 {out['c16']['p50_ms']:.1f} ms, "
        f"p99 {out['c16']['p99_ms']:.1f} ms); {out['c1']['per_s']:.0f}/s at 1 client")  # fmt: skip
    return out


def ray_submit(n: int) -> dict[str, Any]:
    from ray.job_submission import JobStatus, JobSubmissionClient

    head = common.ray_head()
    client = JobSubmissionClient(head.dashboard_url)
    latencies, ids = [], []
    started = time.perf_counter()
    for _ in range(n):
        t0 = time.perf_counter()
        ids.append(client.submit_job(entrypoint="true"))
        latencies.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - started
    terminal = {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}
    for sub_id in ids:

        def ended(s: str = sub_id) -> bool:
            return client.get_job_status(s) in terminal

        try:
            common.wait_for(ended, timeout=60, interval=0.2, what=sub_id)
        except TimeoutError:
            client.stop_job(sub_id)
            common.wait_for(ended, timeout=30, interval=0.2, what=sub_id)
        client.delete_job(sub_id)
    result = {"requests": n, "concurrency": 1, "seconds": elapsed, "per_s": n / elapsed,
              "p50_ms": common.median(latencies) * 1e3, "p99_ms": common.pct(latencies, 99) * 1e3}  # fmt: skip
    log(f"part 2: Ray submit_job: {result['per_s']:.2f}/s (p50 {result['p50_ms']:.0f} ms)")
    return result


def run(quick: bool) -> dict[str, Any]:
    from service.backends.ray_local import free_port

    work = Path(tempfile.mkdtemp(prefix="shunter-bench-submit-"))
    results: dict[str, Any] = {}
    port = free_port()
    proc = _serve([sys.executable, "-m", "bench.bare_app", str(port)], common.base_env(), port, work / "bare.log")
    try:
        results["bare FastAPI"] = _load("bare FastAPI", f"http://127.0.0.1:{port}/v1/jobs", quick)
    finally:
        common.stop(proc)
    kinds = ["sqlite"] + (["postgres"] if common.postgres_available() else [])
    for kind in kinds:
        with common.fresh_db(kind, work) as url:
            port = free_port()
            env = common.base_env(SHUNTER_DATABASE_URL=url, SHUNTER_BACKEND=f"noop:{work / uuid.uuid4().hex[:6]}",
                                  SHUNTER_DATA_DIR=str(work), SHUNTER_PORT=str(port))  # fmt: skip
            proc = _serve(common.shunter_cmd("api"), env, port, work / f"api-{kind}.log")
            try:
                results[f"shunter {kind}"] = _load(f"shunter {kind}", f"http://127.0.0.1:{port}/v1/jobs", quick)
            finally:
                common.stop(proc)
    results["Ray submit_job"] = ray_submit(3 if quick else 6)
    bare = results["bare FastAPI"]["c16"]["per_s"]
    ray_rate = results["Ray submit_job"]["per_s"]
    ratios = {}
    for kind in kinds:
        r = results[f"shunter {kind}"]
        ratios[f"shunter {kind}/bare FastAPI (16 clients)"] = r["c16"]["per_s"] / bare
        ratios[f"shunter {kind}/bare FastAPI (1 client)"] = r["c1"]["per_s"] / results["bare FastAPI"]["c1"]["per_s"]
        ratios[f"shunter {kind} (1 client)/Ray submit_job"] = r["c1"]["per_s"] / ray_rate
        ratios[f"shunter {kind} (16 clients)/Ray submit_job"] = r["c16"]["per_s"] / ray_rate
    targets = {}
    for kind in kinds:
        r = results[f"shunter {kind}"]
        ratios[f"shunter {kind}/bare FastAPI p99 (16 clients)"] = (
            r["c16"]["p99_ms"] / results["bare FastAPI"]["c16"]["p99_ms"]
        )
        targets[f"{kind}: >= 0.5x bare endpoint"] = ratios[f"shunter {kind}/bare FastAPI (16 clients)"] >= 0.5
        targets[f"{kind}: p99 <= 2x bare endpoint's (16 clients)"] = (
            ratios[f"shunter {kind}/bare FastAPI p99 (16 clients)"] <= 2.0
        )
        targets[f"{kind}: >= 100x Ray submit rate"] = ratios[f"shunter {kind} (1 client)/Ray submit_job"] >= 100
    return {"results": results, "ratios": ratios, "targets": targets}
