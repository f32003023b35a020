"""Train loops the worker tests run inside Ray: tiny models, a few steps, with files the test can inspect."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from service.spec.strategy import StrategySpec
from workers.checkpoint import full_state_dict
from workers.strategies import prepare, seed_everything, world


def tiny_model(name: str) -> torch.nn.Module:
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=64, n_positions=32))
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


def tiny_data(name: str) -> TensorDataset:
    """Each sample ends with its index, so a test can tell which samples each rank read."""
    generator = torch.Generator().manual_seed(1)
    if name == "gpt2":
        starts = torch.randint(0, 64, (32, 1), generator=generator)
        return TensorDataset((starts + torch.arange(16)) % 17, torch.arange(32))  # next token = token + 1
    x = torch.randn(64, 8, generator=generator)
    return TensorDataset(x, x @ torch.randn(8, 1, generator=generator), torch.arange(64))


def strategy_loop(config: dict[str, Any]) -> None:
    """Train `steps` optimizer steps, checkpoint at the end; record losses, steps and parameters for the test."""
    strategy = StrategySpec.model_validate(config["strategy"])
    out = Path(config["out"])
    tag = config["tag"]
    seed_everything(0)
    name = config.get("model", "mlp")
    model = tiny_model(name)
    loader = DataLoader(tiny_data(name), batch_size=4, shuffle=True)
    prepared = prepare(
        model,
        lambda params: torch.optim.AdamW(params, lr=config.get("lr", 1e-2)),
        loader,
        strategy=strategy,
        resume_from=config.get("resume_from"),
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0),
    )
    rank, _ = world()
    if prepared.step:  # resumed: record what was restored before training on
        restored = full_state_dict(prepared)
        if rank == 0:
            torch.save(restored, out / f"{tag}-restored.pt")
    records: list[dict[str, Any]] = []
    samples: list[list[int]] = []  # per micro-batch: (epoch, the indices this rank read)
    for epoch in prepared.epochs(1000):
        for batch in prepared.batches():
            samples.append([epoch, *batch[-1].tolist()])
            if name == "gpt2":
                ids, _ = batch
                loss = prepared.model(input_ids=ids, labels=ids).loss
            else:
                x, y, _ = batch
                with prepared.autocast():
                    loss = torch.nn.functional.mse_loss(prepared.model(x), y)
            if prepared.backward(loss):
                records.append({"step": prepared.step, "loss": loss.item(), "time": time.monotonic()})
                every = config.get("checkpoint_every", 0)
                prepared.report(
                    loss=loss,
                    checkpoint=prepared.step == config["steps"] or bool(every and prepared.step % every == 0),
                    **config.get("metrics", {}),
                )
                marker = out / "crashed"
                if prepared.step == config.get("crash_at") and rank == 1 and not marker.exists():
                    marker.write_text("")
                    os._exit(1)  # a hard worker death: Ray Train restarts the group from the last checkpoint
                if prepared.step >= config["steps"]:
                    break
        if prepared.step >= config["steps"]:
            break
    (out / f"{tag}-samples-rank{rank}.json").write_text(json.dumps(samples))
    final = full_state_dict(prepared)
    if rank == 0:
        torch.save(final, out / f"{tag}-final.pt")
        (out / f"{tag}-records.json").write_text(json.dumps(records))


def strategy_cases_loop(config: dict[str, Any]) -> None:
    """`strategy_loop` for each of `config["cases"]` in turn, in one worker group: one fit's process starts, imports
    and process group for several strategies (issue 34), each case a run of its own. Each case starts as a new run
    would, from its own `resume_from` or from nothing, not from the checkpoint the case before it reported last (Ray
    Train hands a worker that one, as it would to a restarted worker group of the same run)."""
    from ray.train.v2._internal.execution.context import get_train_context

    for case in config["cases"]:
        get_train_context().checkpoint = None
        try:
            strategy_loop(case)
        except Exception as exc:
            raise RuntimeError(f"case {case['metrics']['case']}: {exc}") from exc


def full_loss(name: str, state: dict[str, torch.Tensor] | None = None) -> float:
    """The loss over the whole tiny dataset of a model with `state` (default: the weights every loop starts from)."""
    seed_everything(0)
    model = tiny_model(name)
    if state is not None:
        model.load_state_dict(state)
    tensors = tiny_data(name).tensors
    with torch.no_grad():
        if name == "gpt2":
            return float(model(input_ids=tensors[0], labels=tensors[0]).loss)
        return float(torch.nn.functional.mse_loss(model(tensors[0]), tensors[1]))


def mlp_with_secret(config: dict[str, Any]) -> Any:
    """`examples.mlp`'s loop, once this rank has checked that the secret its spec names is in its environment (the
    value's SHA-256 is in the config) and printed it, as a careless script would: the kept log must star it out."""
    import hashlib

    name = config["secret_name"]
    value = os.environ.get(name, "")
    if hashlib.sha256(value.encode()).hexdigest() != config["secret_sha256"]:
        raise RuntimeError(f"{name} is not the value kept for this job's owner")
    if os.environ.get("SHUNTER_BOOTSTRAP") or not os.environ.get("SHUNTER_ATTEMPT_TOKEN"):
        raise RuntimeError("the rank holds the bootstrap credential, or no attempt token")
    print(f"rank sees {name}={value}", flush=True)
    from examples.mlp import train_loop

    return train_loop(config)
