"""What an idle `shunter serve` costs the machine (issue 34): CPU-seconds a second, with nothing queued and nothing
running, on a real local Ray head and SQLite, at several dispatcher ticks, for this checkout and (with --against) an
earlier commit, side by side in one run.

    python -m bench.idle_cost [--ticks 0.25 0.5 1.0] [--against b04e237] [--seconds 30]

Each service is started alone (one after another, on the same warm head), left 5 s to settle, then measured over
`--seconds`: the user and system time of its process and every child. `--against REV` checks REV out in a temporary
git worktree and runs its `shunter serve` from there (this checkout's environment, that commit's code). Writes
bench/results/idle_cost.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

import psutil

from bench import common
from bench.common import log
from service.backends.ray_local import free_port

RESULTS = common.ROOT / "bench" / "results" / "idle_cost.json"


def cpu_of(pid: int) -> float:
    """User + system seconds of `pid` and its children now."""
    total = 0.0
    try:
        root = psutil.Process(pid)
        for proc in [root, *root.children(recursive=True)]:
            try:
                times = proc.cpu_times()
                total += times.user + times.system
            except psutil.Error:
                pass
    except psutil.Error:
        pass
    return total


def idle_rate(code: Path, tick: str, seconds: float) -> float:
    """CPU-seconds a second of one idle `shunter serve` of the code at `code`, at dispatcher tick `tick`."""
    head = common.ray_head()
    work = Path(tempfile.mkdtemp(prefix="shunter-idle-"))
    port = free_port()
    env = common.base_env(
        PYTHONPATH=str(code), SHUNTER_DATABASE_URL=f"sqlite:///{work / 'shunter.db'}", SHUNTER_DATA_DIR=str(work),
        SHUNTER_STORAGE_URI=str(work / "checkpoints"), SHUNTER_RAY_ADDRESS=head.gcs_address,
        SHUNTER_RAY_DASHBOARD_URL=head.dashboard_url, SHUNTER_PORT=str(port), SHUNTER_DISPATCHER_TICK_SECONDS=tick,
    )  # fmt: skip
    proc = subprocess.Popen(common.shunter_cmd("serve"), env=env, cwd=code, stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    common._PROCS.append(proc)
    try:
        common.wait_http(f"http://127.0.0.1:{port}/healthz", timeout=90, proc=proc)
        time.sleep(5)
        before = cpu_of(proc.pid)
        time.sleep(seconds)
        return (cpu_of(proc.pid) - before) / seconds
    finally:
        common.stop(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ticks", nargs="+", default=["0.25", "0.5", "1.0"])
    parser.add_argument("--against", default=None, help="an earlier commit to measure beside this checkout")
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    trees = {"this checkout": common.ROOT}
    worktree = None
    if args.against:
        worktree = Path(tempfile.mkdtemp(prefix="shunter-against-")) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(worktree), args.against], cwd=common.ROOT,
                       check=True, capture_output=True)  # fmt: skip
        trees[args.against] = worktree
    rates: dict[str, dict[str, float]] = {name: {} for name in trees}
    try:
        for tick in args.ticks:
            for name, code in trees.items():
                rates[name][tick] = round(idle_rate(code, tick, args.seconds), 3)
                log(f"{name}, tick {tick} s: {rates[name][tick]:.3f} CPU-s a second, idle")
    finally:
        common.stop_all()
        common.close_ray_head()
        if worktree is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=common.ROOT, check=False)
    out = {"seconds": args.seconds, "cpu_seconds_per_second": rates}
    if args.against:
        out["ratio_to_against"] = {t: round(rates["this checkout"][t] / rates[args.against][t], 2) for t in args.ticks}
        for tick, ratio in out["ratio_to_against"].items():
            print(f"tick {tick} s: this checkout idles at {ratio:.2f}x the CPU of {args.against}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
