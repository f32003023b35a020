"""The benchmark's DDP job as a plain torchrun script: `torchrun --nproc_per_node=2 bench/ddp_torchrun.py`."""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.ddp import HIDDEN, build_model, run_steps  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(build_model(args.hidden))
    run_steps(model, rank=dist.get_rank(), world=dist.get_world_size(), steps=args.steps, out=args.out,
              report=lambda step, loss: None)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
