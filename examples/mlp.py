"""A tiny MLP regression trained with DDP: the example job, and the train loop the tests run.

A plain Ray Train loop, as users write one: `prepare_model` / `prepare_data_loader`, resume from
`ray.train.get_checkpoint()`, report `step` and `loss` (every rank reports; rank 0 writes the checkpoint).
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def make_data(n: int = 2048, dim: int = 16, seed: int = 0) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=gen)
    w = torch.randn(dim, 1, generator=gen)
    y = x @ w + 0.01 * torch.randn(n, 1, generator=gen)
    return TensorDataset(x, y)


def build_model(dim: int = 16, hidden: int = 64) -> nn.Module:
    return nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))


def block_forever() -> None:
    """A rank that stops making progress, as one in a hung collective does (stall tests: `hang_at_step`)."""
    while True:
        time.sleep(3600)


def train_loop(config: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch

    total_steps = int(config.get("total_steps", 50))
    every = int(config.get("checkpoint_every", 10))
    report_every = int(config.get("report_every", 1))
    step_sleep = float(config.get("step_sleep", 0.0))  # lets tests catch a job mid-run
    fail_at = config.get("fail_at_step")  # fault tests: raise at this step on rank 0, first run only
    crash_at = config.get("crash_at_step")  # fault tests: the rank-0 process dies at this step, first run only
    hang_at = config.get("hang_at_step")  # stall tests: every rank blocks for ever once this many steps are done
    # Chaos tests: rank 0 appends "<attempt> <step>" to this file after each step, so a test can see every step
    # that ran (and ran twice), whatever the service recorded.
    trace_path = config.get("trace_path")
    torch.manual_seed(int(config.get("seed", 0)))

    model = ray.train.torch.prepare_model(build_model(hidden=int(config.get("hidden", 64))))
    optimizer = torch.optim.Adam(model.parameters(), lr=float(config.get("lr", 1e-2)))
    loader = ray.train.torch.prepare_data_loader(
        DataLoader(make_data(), batch_size=int(config.get("batch_size", 64)), shuffle=True)
    )
    step = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            state = torch.load(os.path.join(directory, "state.pt"), weights_only=False)
        model.module.load_state_dict(state["model"]) if hasattr(model, "module") else model.load_state_dict(
            state["model"]
        )
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["step"])
        print(f"resumed from step {step}", flush=True)
    init_step = None
    if checkpoint is None and config.get("init_from"):
        # Fine-tuning: start from another run's weights (e.g. "${deps.pre.checkpoint}", filled in by shunter), with
        # a fresh optimizer and step count.
        with ray.train.Checkpoint(path=str(config["init_from"])).as_directory() as directory:
            state = torch.load(os.path.join(directory, "state.pt"), weights_only=False)
        (model.module if hasattr(model, "module") else model).load_state_dict(state["model"])
        init_step = int(state["step"])
        print(f"initialised from {config['init_from']} (its step {init_step})", flush=True)

    ctx = ray.train.get_context()
    epoch, loss = 0, None
    while step < total_steps:
        if hasattr(loader, "sampler") and hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        for x, y in loader:
            if hang_at is not None and step >= int(hang_at):
                block_forever()
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            first_run = checkpoint is None and ctx.get_world_rank() == 0
            if fail_at is not None and step == int(fail_at) and first_run:
                raise RuntimeError(f"injected failure at step {step}")
            if crash_at is not None and step == int(crash_at) and first_run:
                print(f"crashing at step {step}", flush=True)
                os._exit(1)
            if step_sleep:
                time.sleep(step_sleep)
            if trace_path and ctx.get_world_rank() == 0:
                with open(trace_path, "a") as trace:
                    trace.write(f"{os.environ.get('SHUNTER_ATTEMPT', '?')} {step}\n")
            metrics = {"step": step, "loss": float(loss.item()), "epoch": epoch, "world_size": ctx.get_world_size()}
            if init_step is not None:
                metrics["init_from_step"] = init_step
            if step % every == 0 or step == total_steps:
                with tempfile.TemporaryDirectory() as tmp:
                    if ctx.get_world_rank() == 0:
                        inner = model.module if hasattr(model, "module") else model
                        torch.save({"model": inner.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                                   os.path.join(tmp, "state.pt"))  # fmt: skip
                        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
                    else:
                        ray.train.report(metrics)
            elif step % report_every == 0:
                ray.train.report(metrics)
            if step >= total_steps:
                break
        epoch += 1
    if ctx.get_world_rank() == 0:
        # An attempt resumed from the checkpoint of the last step (its predecessor was lost right after saving it)
        # has nothing left to train: that is a success, not an error.
        final = f"final loss {loss.item():.5f}" if loss is not None else "nothing left to train"
        print(f"done: {step} steps, {final}", flush=True)
