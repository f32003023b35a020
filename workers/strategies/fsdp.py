"""FSDP2 (`fully_shard`): per-block sharding found from the model, mixed precision, CPU offload, checkpointing.

Ray's `prepare_model(parallel_strategy="fsdp")` refuses CPU, so shunter wraps by hand; that path is the same on GPU.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from service.spec.strategy import MixedPrecision, StrategySpec
from workers.strategies.common import (
    OptimizerFactory,
    Prepared,
    SchedulerFactory,
    broadcast_module,
    build_optimizer,
    device,
    distributed_loader,
    local_world_size,
    low_precision_dtype,
    mixed_precision,
    scale_lr,
    world,
)

log = logging.getLogger(__name__)


def block_classes(model: torch.nn.Module, names: list[str] | None = None) -> tuple[type[torch.nn.Module], ...]:
    """The transformer block classes to shard one by one: those named, else the model's `_no_split_modules`."""
    wanted = set(names or getattr(model, "_no_split_modules", None) or [])
    found = {type(m) for m in model.modules() if type(m).__name__ in wanted}
    if names and {c.__name__ for c in found} != set(names):
        present = sorted({type(m).__name__ for m in model.modules()})
        missing = sorted(set(names) - {c.__name__ for c in found})
        raise ValueError(f"strategy.fsdp.wrap_classes: {missing} not in the model; its classes are {present}")
    return tuple(found)


def device_mesh(strategy: StrategySpec, device_type: str) -> Any:
    """A 1-D mesh for full/grad-op sharding, or (replicate, shard) for hybrid sharding: shard within a node."""
    from torch.distributed.device_mesh import init_device_mesh

    _, size = world()
    options = strategy.fsdp_options
    if options.sharding != "hybrid_shard":
        return init_device_mesh(device_type, (size,))
    shard = options.shard_size or local_world_size()
    if size % shard:
        raise ValueError(f"strategy.fsdp.shard_size: {shard} does not divide the world size {size}")
    return init_device_mesh(device_type, (size // shard, shard), mesh_dim_names=("replicate", "shard"))


def _activation_checkpointing(model: torch.nn.Module, blocks: tuple[type[torch.nn.Module], ...]) -> None:
    # HF models know how to checkpoint themselves and keep their state-dict keys (save_pretrained stays valid).
    if hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]  # HF's method, typed by nn.Module.__getattr__
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    if not blocks:
        raise ValueError("strategy.fsdp.activation_checkpointing: no block classes found; name them in wrap_classes")
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, blocks))


def prepare_fsdp(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | OptimizerFactory,
    data_loader: Any,
    *,
    strategy: StrategySpec,
    scheduler: SchedulerFactory | None = None,
) -> Prepared:
    """Shard each block then the root; the optimizer is (re)built over the sharded parameters."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    options = strategy.fsdp_options
    here = device()
    precision = mixed_precision(strategy)
    model.to(here)
    broadcast_module(model)
    blocks = block_classes(model, options.wrap_classes)
    if options.activation_checkpointing:
        _activation_checkpointing(model, blocks)
    kwargs: dict[str, Any] = {
        "mesh": device_mesh(strategy, here.type),
        "reshard_after_forward": options.sharding != "shard_grad_op",
    }
    dtype = low_precision_dtype(precision)
    if dtype is not None:
        # Reduce in fp32: low-precision gradient reduction loses too much across many workers.
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    if options.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=here.type == "cuda")
    for block in [m for m in model.modules() if isinstance(m, blocks)]:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    log.info("FSDP2: sharded %d %s blocks + root (%s)", sum(isinstance(m, blocks) for m in model.modules()),
             [c.__name__ for c in blocks], options.sharding)  # fmt: skip
    opt = build_optimizer(optimizer, model.parameters())
    scaler = None
    if precision is MixedPrecision.fp16:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = ShardedGradScaler()
    if data_loader is not None:
        data_loader = distributed_loader(data_loader)
    scale_lr(opt, strategy, micro_batch_size=getattr(data_loader, "batch_size", None))
    return Prepared(
        model=model,
        module=model,
        optimizer=opt,
        strategy=strategy,
        device=here,
        data_loader=data_loader,
        scheduler=scheduler(opt) if scheduler is not None else None,
        scaler=scaler,
        gradient_accumulation_steps=strategy.accumulation_steps,
    )
