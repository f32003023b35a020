"""What the pre-flight check (issue 17) costs before the first step, side by side in one run: a 2-worker Ray Train
`TorchTrainer` (gloo, CPU) on one local Ray, alternately with the check and without it, each run's first step broken
down into its parts, measured inside the workers:

- `worker group up`: from `fit()` to the train function's first line (Ray Train's placement and process group);
- `pre-flight check`: `workers.preflight.run` (facts, rendezvous, checked all-reduce, bandwidth probes);
- `first step`: a tiny DDP model's first forward, backward and optimizer step.

    .venv/bin/python -m bench.preflight [--rounds 3]

The goal the issue sets: the check under 2 s for 2 workers on CPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from bench.common import log

RESULTS = Path(__file__).resolve().parent / "results" / "preflight.json"


def train(config: dict[str, Any]) -> None:
    entered = time.time()
    import ray.train
    import torch
    from ray.train.torch import prepare_model

    from workers import preflight

    began = time.perf_counter()
    report = preflight.run({"enabled": config["check"], "timeout_seconds": 30, "slow_factor": 4.0})
    checked = time.perf_counter() - began
    model = prepare_model(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    began = time.perf_counter()
    loss = model(torch.randn(32, 64)).pow(2).mean()
    loss.backward()
    opt.step()
    first = time.perf_counter() - began
    if ray.train.get_context().get_world_rank() == 0:  # (Train V2 keeps a report's metrics only with a checkpoint)
        Path(config["out"]).write_text(json.dumps({"group_up": entered - config["fit_at"], "first_step": first,
                                                   "check": checked if config["check"] else 0.0,
                                                   "check_inside": (report or {}).get("seconds", 0.0)}))  # fmt: skip


def one(check: bool, storage: str) -> dict[str, float]:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    trainer = TorchTrainer(
        train, train_loop_config={"check": check, "fit_at": time.time(), "out": f"{storage}/metrics.json"},
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=storage), torch_config=TorchConfig(backend="gloo"),
    )  # fmt: skip
    began = time.time()
    result = trainer.fit()
    if result.error is not None:
        raise result.error
    m = json.loads(Path(storage, "metrics.json").read_text())
    return {k: float(m[k]) for k in ("group_up", "check", "first_step", "check_inside")} | {"fit": time.time() - began}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import tempfile

    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    runs: dict[str, list[dict[str, float]]] = {"with check": [], "without": []}
    with tempfile.TemporaryDirectory(prefix="shunter-preflight-") as storage:
        one(False, storage)  # warm-up: imports and worker processes, counted in neither case
        for i in range(args.rounds):
            for case in ("with check", "without") if i % 2 == 0 else ("without", "with check"):
                runs[case].append(one(case == "with check", storage))
                log(f"round {i + 1} {case}: {runs[case][-1]}")
    ray.shutdown()
    med = {case: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for case, rs in runs.items()}
    print(f"\nfirst-step breakdown, median of {args.rounds} runs each (2 workers, gloo, CPU):")
    print(f"{'part':<20}{'with check':>12}{'without':>12}")
    for key, label in (("group_up", "worker group up"), ("check", "pre-flight check"), ("first_step", "first step")):
        print(f"{label:<20}{med['with check'][key]:>11.3f}s{med['without'][key]:>11.3f}s")
    total = {case: m["group_up"] + m["check"] + m["first_step"] for case, m in med.items()}
    print(f"{'to first step':<20}{total['with check']:>11.3f}s{total['without']:>11.3f}s"
          f"   ratio {total['with check'] / total['without']:.2f}x")  # fmt: skip
    print(f"{'whole fit()':<20}{med['with check']['fit']:>11.3f}s{med['without']['fit']:>11.3f}s"
          f"   ratio {med['with check']['fit'] / med['without']['fit']:.2f}x")  # fmt: skip
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"host": platform.node(), "cpus": __import__("os").cpu_count(),
                                   "rounds": args.rounds, "runs": runs, "median": med}, indent=2) + "\n")  # fmt: skip
    log(f"results: {RESULTS}")


if __name__ == "__main__":
    main()
