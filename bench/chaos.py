"""The long chaos run (issue 13): the same jobs twice on one deployment layout (PostgreSQL, an external Ray head, two
`shunter api` and two `shunter dispatcher` processes), once undisturbed and once under chaos (random SIGKILLs of the
shunter processes, restarted after 0.2-2 s, and one Ray head restart), side by side. Prints the invariants' outcome
and what the chaos cost: wall time, attempts, steps run again since the last checkpoint.

    .venv/bin/python -m bench.chaos [--jobs 50] [--kills 100] [--steps 30] [--seed 13]

Needs PostgreSQL (SHUNTER_BENCH_PG_URL or 127.0.0.1:5432). The harness and the invariants are tests/chaos.py, the
same ones the CI-sized test (tests/service/test_chaos.py) asserts.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

from bench.common import fresh_db, log
from tests.chaos import Chaos, ChaosReport

RESULTS = Path(__file__).resolve().parent / "results" / "chaos.json"


def one(kind: str, args: argparse.Namespace, *, kills: int, head_restart: bool) -> ChaosReport:
    with tempfile.TemporaryDirectory(prefix=f"shunter-chaos-{kind}-") as work, fresh_db("postgres", Path(work)) as url:
        chaos = Chaos(Path(work), url, seed=args.seed, jobs=args.jobs, kills=kills, steps=args.steps,
                      checkpoint_every=args.checkpoint_every, gap=(args.min_gap, args.max_gap),
                      head_restart=head_restart)  # fmt: skip
        chaos.start()
        try:
            report = chaos.run(timeout=args.timeout)
        finally:
            chaos.stop()
    log(f"{kind}: {json.dumps(report.summary())}")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--kills", type=int, default=100)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--min-gap", type=float, default=0.5, help="seconds between kills, at least")
    parser.add_argument("--max-gap", type=float, default=4.0, help="seconds between kills, at most")
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args()

    calm = one("calm", args, kills=0, head_restart=False)
    chaos = one("chaos", args, kills=args.kills, head_restart=True)
    result = {
        "machine": platform.platform(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "args": vars(args), "calm": calm.summary(), "chaos": chaos.summary(),
        "ratios": {
            "wall_time": round(chaos.seconds / calm.seconds, 2),
            "attempts": round(chaos.attempts / max(calm.attempts, 1), 2),
            "steps_run": round(chaos.steps_run / max(calm.steps_run, 1), 3),
        },
    }  # fmt: skip
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'':22}{'calm':>10}{'chaos':>10}{'ratio':>8}")
    for name, a, b in (("wall time (s)", calm.seconds, chaos.seconds), ("attempts", calm.attempts, chaos.attempts),
                       ("steps run", calm.steps_run, chaos.steps_run)):  # fmt: skip
        print(f"{name:22}{a:>10.0f}{b:>10.0f}{b / max(a, 1):>8.2f}")
    print(f"kills {dict(chaos.kills)}, head restarts {chaos.head_restarts}, end reasons {dict(chaos.end_reasons)}")
    print(f"invariants: {'all held' if not (calm.problems or chaos.problems) else calm.problems + chaos.problems}")
    print(f"results: {RESULTS}")
    if calm.problems or chaos.problems:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
