"""A training loop in the style of Hugging Face Accelerate's examples: `Accelerator().prepare(...)`,
`accelerator.backward`, `save_state` into `checkpoint-<step>` folders every `--checkpointing_steps`, and
`--resume_from_checkpoint` through `load_state`. Progress goes through shunter's optional helper (`from workers import
report`), which does nothing outside shunter; the script runs the same under a plain launcher:

    torchrun --nproc_per_node=2 examples/scripts/accelerate_loop.py --output_dir out --max_steps 12 \
        --checkpointing_steps 4

(`accelerate launch` starts the same processes with the same environment.) Under shunter:
`examples/accelerate-loop.yaml`.
"""

from __future__ import annotations

import argparse
import os
import re
import time

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

try:
    from workers import report  # shunter's helper: a no-op outside shunter
except ImportError:  # shunter not installed: nothing to report to

    def report(step: int | None = None, **metrics: float) -> bool:
        return False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", default="out")
    parser.add_argument("--max_steps", type=int, default=12)
    parser.add_argument("--checkpointing_steps", type=int, default=4)
    parser.add_argument("--resume_from_checkpoint", default=None)
    parser.add_argument("--step_seconds", type=float, default=0.0)
    args = parser.parse_args()

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    inputs = torch.randn(512, 16)
    data = TensorDataset(inputs, inputs.sum(dim=1, keepdim=True))
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(data, batch_size=16, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    step = 0
    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)
        step = int(re.findall(r"\d+", os.path.basename(os.path.normpath(args.resume_from_checkpoint)))[-1])
        accelerator.print(f"resumed from {args.resume_from_checkpoint} at step {step}")
    while step < args.max_steps:
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if args.step_seconds:
                time.sleep(args.step_seconds)
            if accelerator.is_main_process:
                report(step=step, loss=loss.item())
                accelerator.print(f"step {step} loss {loss.item():.4f}")
            if step % args.checkpointing_steps == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"checkpoint-{step}"))
            if step >= args.max_steps:
                break
    accelerator.wait_for_everyone()
    accelerator.print(f"done at step {step}")


if __name__ == "__main__":
    main()
