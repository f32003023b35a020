"""A hostile tenant's flood against a well-behaved one (issue 35), on PostgreSQL by default: alice's submit latency,
quiet and then while mallory floods the service every way a tenant can, side by side in one run.

    python -m bench.flood [--db postgres|sqlite] [--submits 300] [--without report|sweep|"log read"]

One `shunter api` process (tokens on; the noop backend, so nothing trains) on a fresh database. Mallory's flood, from
a process of its own (as an attacker's client is not in alice's):
- from inside a job of hers (its attempt token): four threads posting reports of 256 metrics each, as fast as the
  API answers (the audit's 6,100 rows a second);
- sweeps of 100 members with ~4 KB of config each, one after another;
- eight readers of her running job's log, each as often as answered.
Alice meanwhile submits one job at a time. The figures: alice's p50 and p99 quiet and under the flood (the issue asks
p99 under 2x quiet), twice: with the flood's process as eager for the 2 cores as shunter's (nice 0), then as if it ran
on a host of its own (nice 19: an attacker's client does not share the service's CPUs), each split by the API's
Server-Timing into the wait for a place in its gate and the work, and
what mallory got (accepted, refused with 429, other). Writes bench/results/flood.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from bench import common
from bench.common import log, median, pct
from service.backends.ray_local import free_port

RESULTS = common.ROOT / "bench" / "results" / "flood.json"
ALICE, MALLORY = "alice-bench-token", "mallory-bench-token"
SECRET = "flood-bench-progress-secret-" + "k" * 16
SPEC = {"entrypoint": {"callable": "examples.mlp:train_loop"}, "resources": {"num_workers": 1},
        "config": {"total_steps": 10}}  # fmt: skip


def submits(url: str, n: int) -> dict[str, list[float]]:
    """Alice's submits, one after another: each one's seconds as she saw it ("total"), and as the API's Server-Timing
    splits it: waiting for a place in its gate ("gate"), then to the answer's first byte ("app")."""
    took: dict[str, list[float]] = {"total": [], "gate": [], "app": []}
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ALICE}"}, timeout=60) as c:
        for i in range(n):
            t0 = time.perf_counter()
            r = c.post("/v1/jobs", json=SPEC | {"name": f"alice-{i}"})
            took["total"].append(time.perf_counter() - t0)
            if r.status_code != 201:
                raise RuntimeError(f"alice's submit answered {r.status_code}: {r.text[:300]}")
            timing = dict(part.strip().split(";dur=") for part in r.headers.get("server-timing", "").split(",") if part)
            took["gate"].append(float(timing.get("gate", 0)) / 1e3)
            took["app"].append(float(timing.get("app", 0)) / 1e3)
    return took


def summary(took: dict[str, list[float]]) -> dict[str, Any]:
    """p50 and p99 of the total, with the gate's and the app's share of each request at those two ranks."""

    def at(q: float) -> dict[str, float]:
        ranked = sorted(range(len(took["total"])), key=lambda i: took["total"][i])
        i = ranked[min(len(ranked) - 1, round(q * (len(ranked) - 1)))]
        return {part: round(took[part][i] * 1e3, 2) for part in ("total", "gate", "app")}

    return {"n": len(took["total"]), "p50_ms": round(median(took["total"]) * 1e3, 2),
            "p99_ms": round(pct(took["total"], 99) * 1e3, 2), "at_p50": at(0.5), "at_p99": at(0.99)}  # fmt: skip


def running_job_of_mallory(db_url: str) -> tuple[str, str]:
    """A job of mallory's on its first attempt, RUNNING (as the dispatcher leaves one), and its bootstrap credential."""
    from sqlmodel import Session

    from service.spec.job import JobSpec
    from service.store.db import make_engine
    from service.store.models import Attempt, Job, JobState
    from service.tenancy import attempt_tokens

    engine = make_engine(db_url)
    job = Job(name="flood", owner="mallory", spec=JobSpec.model_validate(SPEC).model_dump(mode="json"),
              state=JobState.RUNNING, attempt=1)  # fmt: skip
    with Session(engine) as session:
        session.add(job)
        session.commit()
        session.add(Attempt(job_id=job.id, number=1, submission_id=f"shunter-{job.id}-1"))
        session.commit()
        job_id = job.id
    engine.dispose()
    return job_id, attempt_tokens.issue(job_id, 1, SECRET, prefix=attempt_tokens.BOOTSTRAP)


def attempt_token(url: str, job_id: str, bootstrap: str) -> str:
    """The attempt token, as mallory's driver gets it: for the bootstrap credential (it names her as its owner)."""
    r = httpx.post(f"{url}/internal/v1/attempts/{job_id}/1/bootstrap", json={"nonce": "n" * 43},
                   headers={"Authorization": f"Bearer {bootstrap}"}, timeout=30)  # fmt: skip
    r.raise_for_status()
    return str(r.json()["token"])


class Flood:
    """Mallory's flood, in threads of its own process (`__enter__` starts it): alice's client is timed in this one,
    and must not wait on the flood's threads for this process's GIL, as it would for no attacker on another host."""

    def __init__(self, url: str, job_id: str, token: str, nice: int = 0, without: tuple[str, ...] = ()) -> None:
        self.url, self.job_id, self.token, self.nice = url, job_id, token, nice
        ctx = multiprocessing.get_context("spawn")
        self._stop = ctx.Event()
        self._counts: Any = ctx.Queue()
        self._process = ctx.Process(target=_flood, args=(url, job_id, token, nice, without, self._stop, self._counts),
                                    name="mallory", daemon=True)  # fmt: skip
        self.got: Counter[str] = Counter()

    def __enter__(self) -> Flood:
        self._process.start()
        time.sleep(3.0)  # under way before alice's first submit
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.got.update(self._counts.get(timeout=120))
        self._process.join(timeout=30)


def _flood(url: str, job_id: str, token: str, nice: int, without: tuple[str, ...], stop: Any, counts: Any) -> None:
    """The flood's process: four threads posting reports of 256 metrics from inside mallory's job, one posting sweeps,
    eight reading her job's log; each as fast as answered. Puts what it got on `counts` once `stop` is set."""
    import os

    os.nice(nice)
    got: Counter[str] = Counter()
    lock = threading.Lock()

    def count(what: str, r: httpx.Response | None) -> None:
        code = "error" if r is None else ("ok" if r.status_code < 300 else str(r.status_code))
        with lock:
            got[f"{what} {code}"] += 1

    def loop(what: str, headers: dict[str, str], call: Any) -> None:
        with httpx.Client(base_url=url, headers=headers, timeout=60) as c:
            while not stop.is_set():
                try:
                    count(what, call(c))
                except httpx.HTTPError:
                    count(what, None)

    report = {"metrics": {f"m{k}": float(k) for k in range(256)}, "step": 1}
    report_path = f"/internal/v1/attempts/{job_id}/1/report"
    sweep = {"base": SPEC | {"config": {"blob": "x" * 4000}}, "count": 100}
    mallory = {"Authorization": f"Bearer {MALLORY}"}
    parts = [  # what, how many threads, their headers, each one's call
        ("report", 4, {"Authorization": f"Bearer {token}"}, lambda c: c.post(report_path, json=report)),
        ("sweep", 1, mallory, lambda c: c.post("/v1/sweeps", json=sweep)),
        ("log read", 8, mallory, lambda c: c.get(f"/v1/jobs/{job_id}/logs")),
    ]
    threads = [threading.Thread(target=loop, args=(what, headers, call))
               for what, n, headers, call in parts if what not in without for _ in range(n)]  # fmt: skip
    for t in threads:
        t.start()
    stop.wait()
    for t in threads:
        t.join(timeout=90)
    counts.put(dict(got))


def run(kind: str, n: int, nice: int = 0, without: tuple[str, ...] = ()) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, common.fresh_db(kind, Path(tmp)) as db_url:
        port = free_port()
        env = common.base_env(
            SHUNTER_DATABASE_URL=db_url, SHUNTER_PORT=str(port), SHUNTER_DATA_DIR=str(Path(tmp) / "data"),
            SHUNTER_STORAGE_URI=str(Path(tmp) / "storage"), SHUNTER_BACKEND=f"noop:{Path(tmp) / 'noop'}",
            SHUNTER_PROGRESS_SECRET=SECRET, SHUNTER_PUBLIC_URL=f"http://127.0.0.1:{port}",
            SHUNTER_API_TOKENS=json.dumps({ALICE: {"owner": "alice"}, MALLORY: {"owner": "mallory"}}),
        )  # fmt: skip
        api = common.spawn(common.shunter_cmd("api"), env=env, log_path=Path(tmp) / "api.log")
        url = f"http://127.0.0.1:{port}"
        try:
            common.wait_http(f"{url}/healthz", timeout=90, proc=api)
            job_id, bootstrap = running_job_of_mallory(db_url)
            token = attempt_token(url, job_id, bootstrap)
            submits(url, 30)  # warm: connections, caches
            quiet = summary(submits(url, n))
            log(f"quiet: alice's submit p50 {quiet['p50_ms']} ms, p99 {quiet['p99_ms']} ms")
            with Flood(url, job_id, token, nice, without) as flood:
                started = time.monotonic()
                loud = summary(submits(url, n))
                seconds = time.monotonic() - started
            log(f"flood: alice's submit p50 {loud['p50_ms']} ms, p99 {loud['p99_ms']} ms (at p50 {loud['at_p50']}, at "
                f"p99 {loud['at_p99']}); mallory got "
                f"{dict(flood.got)} in {seconds:.0f} s")  # fmt: skip
        finally:
            common.stop(api)
            with contextlib.suppress(OSError):
                log_tail = (Path(tmp) / "api.log").read_text()[-2000:]
                if "Traceback" in log_tail:
                    log(f"api log ends:\n{log_tail}")
    return {"db": kind, "quiet": quiet, "flood": loud, "p99_ratio": round(loud["p99_ms"] / quiet["p99_ms"], 2),
            "p50_ratio": round(loud["p50_ms"] / quiet["p50_ms"], 2), "mallory": dict(flood.got),
            "flood_seconds": round(seconds, 1)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--db", choices=("postgres", "sqlite"), default="postgres")
    parser.add_argument("--submits", type=int, default=1000, help="alice's submits in each phase")
    parser.add_argument("--flood-nice", type=int, action="append", default=None,
                        help="the flood process's niceness (default: 0, then 19: the attacker's client on these "
                             "cores as much as shunter, then as if on a host of its own)")  # fmt: skip
    parser.add_argument(
        "--without",
        action="append",
        default=[],
        choices=("report", "sweep", "log read"),
        help="leave this part out of the flood (to see what each part costs alice)",
    )
    args = parser.parse_args(argv)
    runs = {f"flood_nice_{n}": run(args.db, args.submits, n, tuple(args.without)) for n in args.flood_nice or (0, 19)}
    result = {**runs, "p99_ratios": {k: r["p99_ratio"] for k, r in runs.items()}}
    print(json.dumps(result, indent=2))
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
