"""The one DDP job of the orchestration benchmark: an MLP of ~1.03M parameters on gloo, a fixed number of steps.

The same `run_steps` runs under bare torchrun (bench/ddp_torchrun.py), a bare Ray Job (bench/bare_trainer.py) and
shunter (entrypoint `bench.ddp:train_loop`). It times every step itself and rank 0 writes a JSON summary to
`config["out"]`: the wall time of the end of the first step, the median step time, the end of the loop.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

DIM, HIDDEN, BATCH = 64, 700, 64


def build_model(hidden: int = HIDDEN) -> nn.Module:
    return nn.Sequential(
        nn.Linear(DIM, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1),
    )  # fmt: skip


def run_steps(
    model: nn.Module,
    *,
    rank: int,
    world: int,
    steps: int,
    out: str | None,
    report: Callable[[int, float], None],
    marks: dict[str, float] | None = None,
) -> dict[str, Any]:
    loop_start = time.time()
    gen = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(32 * BATCH, DIM, generator=gen)
    y = x[:, :1] * 0.5 + 0.1 * torch.randn(32 * BATCH, 1, generator=gen)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    durations: list[float] = []
    first_step_at = None
    loss = torch.tensor(0.0)
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        i = (step * BATCH) % (x.shape[0] - BATCH)
        loss = nn.functional.mse_loss(model(x[i : i + BATCH]), y[i : i + BATCH])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        durations.append(time.perf_counter() - t0)
        if first_step_at is None:
            first_step_at = time.time()
        report(step, float(loss.item()))
    summary = {
        "rank": rank,
        "world": world,
        "steps": steps,
        "params": sum(p.numel() for p in model.parameters()),
        **(marks or {}),  # when this process started and entered the train function (a Ray Train worker's)
        "loop_start_at": loop_start,
        "first_step_at": first_step_at,
        "end_at": time.time(),
        # The first steps include DDP's bucket set-up; the median is what a step costs.
        "step_ms_median": statistics.median(durations) * 1e3,
        "step_ms_mean": statistics.fmean(durations[5:] or durations) * 1e3,
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "final_loss": float(loss.item()),
    }
    if rank == 0 and out:
        with open(out + ".tmp", "w") as handle:
            json.dump(summary, handle)
        os.replace(out + ".tmp", out)
    return summary


def train_loop(config: dict[str, Any]) -> None:
    """Ray Train loop (bare Ray Job and shunter): report every `report_every` steps, from every rank."""
    entered = time.time()
    import psutil
    import ray.train
    import ray.train.torch

    marks = {"worker_started_at": psutil.Process().create_time(), "train_fn_entered_at": entered}

    torch.manual_seed(0)
    ctx = ray.train.get_context()
    model = ray.train.torch.prepare_model(build_model(int(config.get("hidden", HIDDEN))))
    every = int(config.get("report_every", 50))
    steps = int(config.get("total_steps", 300))

    def report(step: int, loss: float) -> None:
        if step % every == 0 or step == steps:
            ray.train.report({"step": step, "loss": loss})

    marks["model_prepared_at"] = time.time()
    run_steps(model, rank=ctx.get_world_rank(), world=ctx.get_world_size(), steps=steps, out=config.get("out"),
              report=report, marks=marks)  # fmt: skip
