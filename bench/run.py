"""One command for every benchmark: `python -m bench.run [--quick] [--only NAME]`.

Parts: orchestration, submission, claims, depth, admission. Results: bench/results/latest.json (+ latest.png when
matplotlib is installed: the dev extra has it) and a table of ratios measured side by side in this run.

Honest runs: the load average is recorded before each part, and a part is not run (it is reported as refused) while
the 1-minute load average stays above the number of cores for `--wait-for-quiet` seconds: figures taken on a busy
machine disagree with a quiet run's by more than the differences they are meant to show. `--allow-load` runs anyway
(and says so in the results).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from bench import common
from bench.common import log

PARTS = ("orchestration", "submission", "claims", "depth", "admission")
RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    import torch

    return {
        "cpus": os.cpu_count(),
        "gpu": torch.cuda.is_available(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "load_avg_at_start": os.getloadavg(),
    }


def commit() -> str | None:
    """The checkout's commit, with "+changes" when the tree differs from it (the figures are the tree's)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}+changes" if dirty else head


def quiet(wait_s: float) -> tuple[bool, float]:
    """Whether the 1-minute load average is at most the core count, waiting up to `wait_s` for it; and the load."""
    cpus = os.cpu_count() or 1
    deadline = time.monotonic() + wait_s
    while True:
        load = os.getloadavg()[0]
        if load <= cpus:
            return True, load
        if time.monotonic() >= deadline:
            return False, load
        log(f"load average {load:.2f} is above {cpus} cores: waiting for a quiet machine")
        time.sleep(min(10.0, max(0.0, deadline - time.monotonic())))


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "MET" if value else "not met"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def table(results: dict[str, Any]) -> str:
    lines = []
    for part, res in results["parts"].items():
        load = res.get("load_avg_before")
        said_load = f", load {load:.2f} before" if load is not None else ""
        lines.append(f"\n== {part} ({res.get('seconds', 0):.0f}s{said_load}) ==")
        if "refused" in res:
            lines.append(f"  REFUSED: {res['refused']}")
            continue
        if "error" in res:
            lines.append(f"  ERROR: {res['error']}")
            continue
        for key in ("median", "results", "rows"):
            if key in res:
                lines.extend(_figures(key, res[key]))
        for name, ratio in res.get("ratios", {}).items():
            lines.append(f"  ratio  {name:<58} {ratio:8.3f}")
        for name, met in res.get("targets", {}).items():
            lines.append(f"  target {name:<58} {_fmt(met)}")
        if "median_loop_end_to_starting_s" in res:
            lines.append(f"  loop end -> next STARTING {res['median_loop_end_to_starting_s']:.2f}s; Ray Job end -> "
                         f"STARTING {res['median_ray_end_to_starting_s']:+.2f}s; SUCCEEDED event -> STARTING "
                         f"{res['median_succeeded_event_to_starting_s']:+.2f}s; tick {res['tick_s']}s")  # fmt: skip
    return "\n".join(lines)


def _figures(key: str, data: Any) -> list[str]:
    out = []
    if key == "median":  # orchestration
        out.append(f"  {'way':<14} {'end-to-end s':>12} {'submit->step1 s':>16} {'ms/step':>8}")
        for way, m in data.items():
            out.append(f"  {way:<14} {m['end_to_end_s']:12.2f} {m['submit_to_first_step_s']:16.2f} "
                       f"{m['step_ms_median']:8.2f}")  # fmt: skip
    elif key == "results":  # submission
        for name, r in data.items():
            for conc, m in r.items() if "c16" in r else [("c1", r)]:
                out.append(f"  {name:<16} {conc:>4}: {m['per_s']:9.1f}/s  p50 {m['p50_ms']:8.1f} ms  "
                           f"p99 {m['p99_ms']:8.1f} ms")  # fmt: skip
    elif key == "rows":
        for row in data:
            out.append("  " + ", ".join(f"{k}={_fmt(v)}" for k, v in row.items() if k != "claims_by_dispatcher"))
    return out


def plot(results: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    parts = results["parts"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    orch = parts.get("orchestration", {}).get("median")
    if orch:
        ways = list(orch)
        x = range(len(ways))
        axes[0].bar([i - 0.2 for i in x], [orch[w]["end_to_end_s"] for w in ways], 0.4, label="end to end")
        axes[0].bar([i + 0.2 for i in x], [orch[w]["submit_to_first_step_s"] for w in ways], 0.4, label="to step 1")
        axes[0].set_xticks(list(x), ways)
        axes[0].set_ylabel("seconds")
        axes[0].set_title("2-worker DDP job (1M params, gloo)")
        axes[0].legend()
    claims = parts.get("claims", {}).get("rows")
    if claims:
        for db in sorted({r["db"] for r in claims}):
            rows = [r for r in claims if r["db"] == db and r.get("variant", "as is") == "as is"]
            axes[1].plot([r["dispatchers"] for r in rows], [r["claims_per_s"] for r in rows], "o-", label=db)
        axes[1].axhline(500, ls="--", c="grey", label="target (PG x4)")
        axes[1].set_xlabel("dispatcher processes")
        axes[1].set_ylabel("claims/s")
        axes[1].set_title("claim throughput (noop backend)")
        axes[1].legend()
    depth = parts.get("depth", {}).get("rows")
    if depth:
        for db in sorted({r["db"] for r in depth}):
            rows = [r for r in depth if r["db"] == db and r.get("variant", "as is") == "as is"]
            q = [r["queued"] for r in rows]
            axes[2].plot(q, [r["admit_pass_ms_p50"] for r in rows], "o-", label=f"{db} admit pass")
            axes[2].plot(q, [r["list_ms_p50"] for r in rows], "s--", label=f"{db} GET /v1/jobs")
        axes[2].set_xscale("log")
        axes[2].set_yscale("log")
        axes[2].set_xlabel("queued jobs")
        axes[2].set_ylabel("ms (p50)")
        axes[2].set_title("latency vs queue depth (as is)")
        axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller sizes: each part in about 2 minutes or less")
    parser.add_argument("--only", action="append", choices=PARTS, help="run only this part (repeatable)")
    parser.add_argument("--out", type=Path, default=RESULTS / "latest.json")
    parser.add_argument(
        "--wait-for-quiet",
        type=float,
        default=300.0,
        metavar="S",
        help="before each part, wait up to S seconds for the load average to drop to the core count",
    )
    parser.add_argument("--allow-load", action="store_true", help="run and report parts even on a busy machine")
    args = parser.parse_args(argv)
    os.chdir(common.ROOT)  # Ray's processes get the checkout on PYTHONPATH from here
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parts = args.only or list(PARTS)
    results: dict[str, Any] = {
        "mode": "quick" if args.quick else "full",
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "commit": commit(),
        "machine": machine(),
        "allow_load": args.allow_load,
        "parts": {},
    }
    started = time.monotonic()
    try:
        for name in parts:
            log(f"== {name} ==")
            ok, load = quiet(0.0 if args.allow_load else args.wait_for_quiet)
            t0 = time.monotonic()
            if not ok and not args.allow_load:
                cores = os.cpu_count()
                refused = f"load average {load:.2f} above {cores} cores after {args.wait_for_quiet:.0f} s: not run"
                results["parts"][name] = {"refused": refused, "load_avg_before": load, "seconds": 0.0}
                log(refused)
                continue
            module = __import__(f"bench.{name}", fromlist=["run"])
            try:
                res = module.run(args.quick)
            except Exception as exc:  # noqa: BLE001 - one broken part must not lose the others' numbers
                traceback.print_exc()
                res = {"error": f"{type(exc).__name__}: {exc}"}
            finally:
                common.stop_all()
            res["seconds"] = time.monotonic() - t0
            res["load_avg_before"] = load
            results["parts"][name] = res
    finally:
        common.stop_all()
        common.close_ray_head()
    results["seconds"] = time.monotonic() - started
    results["machine"]["load_avg_at_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1, default=str))
    png = args.out.with_suffix(".png")
    plotted = plot(results, png)
    print(table(results))
    log(f"wrote {args.out}" + (f" and {png}" if plotted else " (no matplotlib: no plot)"))
    return 1 if any("error" in r or "refused" in r for r in results["parts"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
