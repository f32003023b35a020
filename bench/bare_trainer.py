"""A bare Ray Job entrypoint: the benchmark's TorchTrainer run directly, as a user without shunter would.

`python -m bench.bare_trainer --steps 300 --out /tmp/x.json`
"""

from __future__ import annotations

import argparse
import tempfile
import uuid


def main() -> None:
    import time

    import psutil

    timing = {"process_started": psutil.Process().create_time(), "driver_imported": time.time()}
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--report-every", type=int, default=50)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from bench.ddp import train_loop

    ray.init()
    timing["ray_connected"] = time.time()
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"total_steps": args.steps, "report_every": args.report_every, "out": args.out},
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1.0}),
        run_config=RunConfig(name=f"bench-bare-{uuid.uuid4().hex[:8]}", storage_path=tempfile.gettempdir()),
        torch_config=TorchConfig(backend="gloo"),
    )
    timing["fit"] = time.time()
    print("timing: " + " ".join(f"{k}={v:.3f}" for k, v in timing.items()), flush=True)  # as shunter's driver logs it
    trainer.fit()


if __name__ == "__main__":
    main()
