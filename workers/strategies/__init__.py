"""Worker-side training strategies: one train loop, run under DDP, FSDP2 or DeepSpeed as the job spec says.

    prepared = prepare(model, lambda params: torch.optim.AdamW(params, lr=1e-3), loader)
    for epoch in prepared.epochs(num_epochs):
        for x, y in prepared.batches():
            with prepared.autocast():
                loss = loss_fn(prepared.model(x), y)
            if prepared.backward(loss):
                prepared.report(loss=loss, checkpoint=prepared.step % 100 == 0)

`prepare` resumes from `ray.train.get_checkpoint()` by default, so a restarted worker group or a new attempt
continues at the step, optimizer state and RNG state it had saved.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from service.spec.strategy import StrategyKind, StrategySpec
from workers.strategies.common import (
    OptimizerFactory,
    Prepared,
    SchedulerFactory,
    current_strategy,
    device,
    mixed_precision,
    seed_everything,
    world,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "Prepared",
    "current_strategy",
    "device",
    "mixed_precision",
    "prepare",
    "seed_everything",
    "world",
]


def prepare(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | OptimizerFactory | None,
    data_loader: Any = None,
    *,
    scheduler: SchedulerFactory | None = None,
    strategy: StrategySpec | None = None,
    resume: bool = True,
    resume_from: Any = None,
) -> Prepared:
    """Wrap model, optimizer (an instance or a `params -> Optimizer` factory) and loader for the job's strategy.

    A factory is best: FSDP must build the optimizer after sharding. With `resume` the run's latest Ray Train
    checkpoint is loaded (manifest checked), else `resume_from` (Checkpoint, path or URI; Ray Train V2 dropped
    `TorchTrainer(resume_from_checkpoint=...)`), else env SHUNTER_RESUME_FROM.
    """
    strategy = current_strategy(strategy)
    if strategy.kind is StrategyKind.deepspeed:
        from workers.strategies.deepspeed import prepare_deepspeed

        prepared = prepare_deepspeed(model, optimizer, data_loader, strategy=strategy, scheduler=scheduler)
    else:
        if optimizer is None:
            raise ValueError(f"an optimizer is needed for strategy {strategy.kind.value}")
        if strategy.kind is StrategyKind.fsdp:
            from workers.strategies.fsdp import prepare_fsdp

            prepared = prepare_fsdp(model, optimizer, data_loader, strategy=strategy, scheduler=scheduler)
        else:
            from workers.strategies.ddp import prepare_ddp

            prepared = prepare_ddp(model, optimizer, data_loader, strategy=strategy, scheduler=scheduler)
    if resume:
        from workers.checkpoint import load

        load(prepared, resume_from)
    return prepared
