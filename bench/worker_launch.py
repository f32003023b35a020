"""What the set-up step of a Ray worker process costs: Ray's `setup_worker.py` and shunter's `workers/launch_worker.py`
side by side, alternating, each run as a raylet runs it (`python <step> <worker command> --serialized-runtime-env-
context=... --language=PYTHON`) with a runtime env of one variable. The worker command is `python -c pass`, so what is
measured is the step itself plus an empty interpreter, the same for both.

Measured per start: wall seconds and CPU-seconds (the children's rusage: the step, the bash it execs, the python that
bash execs). `python -m bench.worker_launch --starts 40` prints the medians and their ratio; `--out
bench/results/worker_launch.json` keeps them.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import ROOT, log
from service.backends.ray_start import LAUNCHER
from workers.launch_worker import ray_setup_worker

CONTEXT = json.dumps({"env_vars": {"SHUNTER_JOB_ID": "bench"}})
STEPS = {"ray": ray_setup_worker(), "shunter": LAUNCHER}


def one(step: str) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    subprocess.run([sys.executable, step, "-c", "pass", f"--serialized-runtime-env-context={CONTEXT}",
                    "--language=PYTHON"], cwd=ROOT, check=True, timeout=120)  # fmt: skip
    seconds = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return seconds, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=40, help="starts of each step")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    results: dict[str, dict[str, list[float]]] = {kind: {"seconds": [], "cpu_s": []} for kind in STEPS}
    for i in range(args.starts):
        for kind in STEPS if i % 2 == 0 else reversed(STEPS):
            seconds, cpu = one(STEPS[kind])
            results[kind]["seconds"].append(seconds)
            results[kind]["cpu_s"].append(cpu)
    summary: dict[str, dict[str, float]] = {
        kind: {k: round(statistics.median(v), 3) for k, v in r.items()} for kind, r in results.items()
    }
    summary["shunter / ray"] = {k: round(summary["shunter"][k] / summary["ray"][k], 3) for k in ("seconds", "cpu_s")}
    log(f"{args.starts} starts each, medians:")
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.write_text(json.dumps({"starts": args.starts, **summary}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
