"""DDP: Ray Train's `prepare_model` (DistributedDataParallel on gloo or NCCL) and `prepare_data_loader`, through
`workers.session` (a local session under torchrun wraps the same way)."""

from __future__ import annotations

from typing import Any

import torch

from service.spec.strategy import MixedPrecision, StrategySpec
from workers.strategies.common import (
    OptimizerFactory,
    Prepared,
    SchedulerFactory,
    build_optimizer,
    device,
    distributed_loader,
    low_precision_dtype,
    mixed_precision,
    scale_lr,
)


def prepare_ddp(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | OptimizerFactory,
    data_loader: Any,
    *,
    strategy: StrategySpec,
    scheduler: SchedulerFactory | None = None,
) -> Prepared:
    """Wrap for DDP; an optimizer built before wrapping stays valid because DDP keeps the same parameters."""
    from workers import session

    here = device()
    wrapped = session.prepare_model(model)
    module = wrapped.module if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel) else wrapped
    opt = optimizer if isinstance(optimizer, torch.optim.Optimizer) else build_optimizer(optimizer, module.parameters())
    precision = mixed_precision(strategy)
    scaler = None
    if precision is MixedPrecision.fp16:
        scaler = torch.amp.GradScaler(here.type)
    if data_loader is not None:
        data_loader = distributed_loader(data_loader)
    scale_lr(opt, strategy, micro_batch_size=getattr(data_loader, "batch_size", None))
    return Prepared(
        model=wrapped,
        module=module,
        optimizer=opt,
        strategy=strategy,
        device=here,
        data_loader=data_loader,
        scheduler=scheduler(opt) if scheduler is not None else None,
        scaler=scaler,
        autocast_dtype=low_precision_dtype(precision) if here.type == "cuda" else None,
        gradient_accumulation_steps=strategy.accumulation_steps,
    )
