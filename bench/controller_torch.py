"""What an attempt's driver and Ray Train's controller pay to import torch, side by side, alternating:

- the controller, with Ray's own `TorchConfig` and with shunter's `LeanTorchConfig` (workers.torch_config), on one
  local head: its CPU-seconds and resident memory once the workers train;
- the driver building its trainer (`workers.driver.build_trainer`), as it does now (the job's loop named, imported on
  the workers) and as it did before (the job's module imported, and Ray's `TorchConfig`), each in a fresh process.

`python -m bench.controller_torch --rounds 3` prints the medians and their ratios;
`--out bench/results/controller_torch.json` keeps them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


def loop(config: dict[str, Any]) -> None:
    import ray.train

    ray.train.report({"step": 1})
    time.sleep(config["hold"])  # the controller is looked at while the workers train


def controller_sample(started: float, found: dict[str, Any], stop: threading.Event) -> None:
    """The newest TrainController process (started after `started`): its CPU-seconds and RSS, last seen."""
    import psutil

    while not stop.is_set():
        for proc in psutil.process_iter(["cmdline", "create_time"]):
            try:
                if "TrainController" in " ".join(proc.info["cmdline"] or []) and proc.info["create_time"] >= started:
                    cpu = proc.cpu_times()
                    found.update(cpu_s=cpu.user + cpu.system, rss_mb=proc.memory_info().rss / 2**20,
                                 torch="libtorch" in Path(f"/proc/{proc.pid}/maps").read_text())  # fmt: skip
            except (OSError, psutil.Error):
                continue
        stop.wait(0.25)


def fit_once(torch_config: Any, hold: float) -> dict[str, Any]:
    from ray.train import RunConfig, ScalingConfig

    from workers.lean_trainer import trainer_class

    found: dict[str, Any] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=controller_sample, args=(time.time() - 1, found, stop), daemon=True)
    watcher.start()
    trainer = trainer_class()(
        loop, train_loop_config={"hold": hold}, torch_config=torch_config,
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=f"controller-torch-{time.monotonic_ns()}", storage_path=tempfile.gettempdir()),
    )  # fmt: skip
    trainer.fit()
    stop.set()
    watcher.join()
    return found


DRIVER = """
import sys, time
t0 = time.process_time()
from service.spec.job import JobSpec
from workers import driver
spec = JobSpec.model_validate({"entrypoint": {"callable": "examples.mlp:train_loop"}, "resources": {"num_workers": 2}})
if sys.argv[1] == "before":
    import examples.mlp  # what the driver imported before: the job's module, and torch with it
    from ray.train.torch import TorchConfig  # and Ray's TorchConfig
driver.build_trainer(spec, job_id="bench", attempt=1, storage="/tmp/bench-controller-torch", api=None)
import json, psutil
print(json.dumps({"cpu_s": time.process_time() - t0, "rss_mb": psutil.Process().memory_info().rss / 2**20,
                  "torch": "torch" in sys.modules}))
"""


def driver_once(how: str) -> dict[str, Any]:
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", DRIVER, how], cwd=root, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hold", type=float, default=4.0, help="seconds the workers train while looked at")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import ray
    from ray.train.torch import TorchConfig

    from service.backends.ray_local import ensure_local_head, stop_local_head
    from workers.torch_config import LeanTorchConfig

    data = Path(tempfile.mkdtemp(prefix="bench-controller-"))
    head = ensure_local_head(data, num_cpus=4, num_gpus=0)
    ray.init(address=head.gcs_address, log_to_driver=False)
    runs: dict[str, list[dict[str, Any]]] = {"ray TorchConfig": [], "LeanTorchConfig": [], "driver before": [],
                                             "driver now": []}  # fmt: skip
    for _ in range(args.rounds):
        runs["driver before"].append(driver_once("before"))
        runs["driver now"].append(driver_once("now"))
    try:
        for _ in range(args.rounds):
            runs["ray TorchConfig"].append(fit_once(TorchConfig(backend="gloo"), args.hold))
            runs["LeanTorchConfig"].append(fit_once(LeanTorchConfig(backend="gloo"), args.hold))
    finally:
        ray.shutdown()
        stop_local_head(data)
    summary: dict[str, Any] = {
        name: {key: statistics.median(r[key] for r in rs) for key in ("cpu_s", "rss_mb")}
        | {"torch_loaded": [r["torch"] for r in rs]}
        for name, rs in runs.items()
    }
    for label, (old, new) in {"controller ratio": ("ray TorchConfig", "LeanTorchConfig"),
                              "driver ratio": ("driver before", "driver now")}.items():  # fmt: skip
        summary[label] = {key: summary[new][key] / summary[old][key] for key in ("cpu_s", "rss_mb")}
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": runs, "summary": summary}, indent=2) + "\n")


if __name__ == "__main__":
    main()
