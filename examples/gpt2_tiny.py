"""A train loop that runs unchanged under DDP, FSDP2 or DeepSpeed: the strategy comes from the job spec.

    entrypoint: {callable: examples.gpt2_tiny:train_loop}
    config: {steps: 20, lr: 3.0e-3, checkpoint_every: 10}
    strategy: {kind: fsdp}            # or ddp, or deepspeed with deepspeed: {zero_stage: 3}

A 2-layer GPT2 built from a config (no download) learns a next-token pattern; loss, step, lr and samples/s are
reported every step, with a checkpoint every `checkpoint_every` steps and at the end. A restarted worker group or a
new attempt resumes from the latest checkpoint.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from workers.strategies import prepare, seed_everything


def tiny_gpt2(vocab_size: int = 64) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=vocab_size, n_positions=64))


def pattern_data(samples: int = 256, seq_len: int = 32, vocab_size: int = 64) -> TensorDataset:
    """Sequences where each token is the previous plus one (mod 17): quick to learn, so loss visibly falls."""
    starts = torch.randint(0, vocab_size, (samples, 1), generator=torch.Generator().manual_seed(0))
    return TensorDataset((starts + torch.arange(seq_len)) % 17)


def train_loop(config: dict[str, Any]) -> None:
    """train_loop_per_worker for shunter's `entrypoint.callable`."""
    seed_everything(config.get("seed", 0))
    batch_size, steps = int(config.get("batch_size", 8)), int(config.get("steps", 20))
    checkpoint_every = int(config.get("checkpoint_every", 0))
    prepared = prepare(
        tiny_gpt2(),
        lambda params: torch.optim.AdamW(params, lr=float(config.get("lr", 3e-3))),
        DataLoader(pattern_data(), batch_size=batch_size, shuffle=True, drop_last=True),
    )
    started = time.monotonic()
    for _ in prepared.epochs(2**31 - 1):
        for (ids,) in prepared.batches():
            loss = prepared.model(input_ids=ids, labels=ids).loss
            if not prepared.backward(loss):
                continue
            done = prepared.step >= steps
            samples = batch_size * prepared.gradient_accumulation_steps
            prepared.report(
                loss=loss,
                samples_per_s=samples / max(time.monotonic() - started, 1e-9),
                checkpoint=done or bool(checkpoint_every and prepared.step % checkpoint_every == 0),
            )
            if config.get("step_sleep"):
                time.sleep(float(config["step_sleep"]))  # lets tests catch the job mid-run
            started = time.monotonic()
            if done:
                return
