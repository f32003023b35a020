"""DeepSpeed ZeRO 0-3: a config built from the spec's short form, or the user's full config with "auto" resolved.

`deepspeed.init_distributed` reuses the process group Ray Train already set up (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from service.spec.strategy import AUTO, MixedPrecision, StrategySpec
from workers.strategies.common import (
    OptimizerFactory,
    Prepared,
    SchedulerFactory,
    broadcast_module,
    device,
    distributed_loader,
    mixed_precision,
    scale_lr,
    world,
)

log = logging.getLogger(__name__)
WHERE = "strategy.deepspeed.config"


def build_config(
    strategy: StrategySpec,
    *,
    world_size: int,
    micro_batch_size: int | None,
    precision: MixedPrecision,
    use_gpu: bool,
    hidden_size: int | None = None,
    optimizer_defaults: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The DeepSpeed config this job runs with; every "auto" is replaced or refused with the field named."""
    options = strategy.deepspeed_options
    micro = strategy.micro_batch_size or micro_batch_size or 1
    if options.config is not None:
        return resolve_auto(
            options.config, strategy=strategy, world_size=world_size, micro_batch_size=micro, precision=precision,
            hidden_size=hidden_size, optimizer_defaults=optimizer_defaults or {},
        )  # fmt: skip
    accumulation = strategy.accumulation_steps
    stage = options.resolved_zero_stage
    zero: dict[str, Any] = {"stage": stage, "overlap_comm": options.resolved_overlap_comm}
    if stage >= 2:
        zero["contiguous_gradients"] = True
    if options.reduce_bucket_size:
        zero["reduce_bucket_size"] = options.reduce_bucket_size
    if options.allgather_bucket_size:
        zero["allgather_bucket_size"] = options.allgather_bucket_size
    if options.resolved_offload_optimizer == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": use_gpu}
    if options.resolved_offload_param == "cpu":
        zero["offload_param"] = {"device": "cpu", "pin_memory": use_gpu}
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": micro * accumulation * world_size,
        "gradient_clipping": strategy.gradient_clipping or 0.0,
        "zero_optimization": zero,
        "fp16": {"enabled": precision is MixedPrecision.fp16},
        "bf16": {"enabled": precision is MixedPrecision.bf16},
        # A torch optimizer under ZeRO (and offload) is fine; DeepSpeed's own CPU Adam needs a JIT build.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,
    }


def resolve_auto(
    config: dict[str, Any],
    *,
    strategy: StrategySpec,
    world_size: int,
    micro_batch_size: int,
    precision: MixedPrecision,
    hidden_size: int | None,
    optimizer_defaults: dict[str, Any],
) -> dict[str, Any]:
    """Fill the HF-style "auto" values of a full DeepSpeed config from the spec, the model and the optimizer."""
    out = copy.deepcopy(config)
    accumulation = out.get("gradient_accumulation_steps")
    accumulation = strategy.accumulation_steps if accumulation in (None, AUTO) else int(accumulation)
    micro = out.get("train_micro_batch_size_per_gpu")
    micro = micro_batch_size if micro in (None, AUTO) else int(micro)
    out["gradient_accumulation_steps"] = accumulation
    out["train_micro_batch_size_per_gpu"] = micro
    if out.get("train_batch_size") in (None, AUTO):
        out["train_batch_size"] = micro * accumulation * world_size
    if out.get("gradient_clipping") == AUTO:
        out["gradient_clipping"] = strategy.gradient_clipping or 0.0
    for name, wanted in (("fp16", MixedPrecision.fp16), ("bf16", MixedPrecision.bf16)):
        section = out.get(name)
        if isinstance(section, dict) and section.get("enabled") == AUTO:
            section["enabled"] = precision is wanted
    zero = out.get("zero_optimization") or {}
    if hidden_size:
        sizes = {
            "reduce_bucket_size": hidden_size * hidden_size,
            "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
            "stage3_param_persistence_threshold": 10 * hidden_size,
        }
        for key, value in sizes.items():
            if zero.get(key) == AUTO:
                zero[key] = value
    optimizer = out.get("optimizer")
    if isinstance(optimizer, dict):
        params = optimizer.get("params") or {}
        for key, value in list(params.items()):
            if value == AUTO and key in optimizer_defaults:
                params[key] = optimizer_defaults[key]
    out.setdefault("zero_allow_untested_optimizer", True)
    out.setdefault("zero_force_ds_cpu_optimizer", False)
    left = list(_autos(out))
    if left:
        raise ValueError(f'{WHERE}.{left[0]}: "auto" cannot be resolved from the spec; give a value')
    return out


def _autos(value: Any, path: str = "") -> Any:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _autos(item, f"{path}.{key}" if path else str(key))
    elif value == AUTO:
        yield path


def prepare_deepspeed(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | OptimizerFactory | None,
    data_loader: Any,
    *,
    strategy: StrategySpec,
    scheduler: SchedulerFactory | None = None,
) -> Prepared:
    """`deepspeed.initialize` over Ray's process group; a full config's own `optimizer` section wins."""
    import deepspeed

    here = device()
    deepspeed.init_distributed(dist_backend="nccl" if here.type == "cuda" else "gloo")
    model.to(here)
    broadcast_module(model)
    if data_loader is not None:
        data_loader = distributed_loader(data_loader)
    precision = mixed_precision(strategy)
    client: torch.optim.Optimizer | None = None
    if optimizer is not None:
        client = optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer(model.parameters())
        scale_lr(client, strategy, micro_batch_size=getattr(data_loader, "batch_size", None))
    config = build_config(
        strategy,
        world_size=world()[1],
        micro_batch_size=getattr(data_loader, "batch_size", None),
        precision=precision,
        use_gpu=here.type == "cuda",
        hidden_size=getattr(getattr(model, "config", None), "hidden_size", None),
        optimizer_defaults={k: v for k, v in (client.defaults if client else {}).items() if k != "params"},
    )
    if "optimizer" not in config and client is None:
        raise ValueError(
            "deepspeed: give the train loop's optimizer, or an optimizer section in strategy.deepspeed.config"
        )
    if "optimizer" in config and client is not None:
        log.warning("the DeepSpeed config has an optimizer section: it replaces the optimizer the train loop gave")
        client = None
    if world()[0] == 0:  # what runs, in the job's log: a full config's values can differ from the short form's
        zero = config.get("zero_optimization") or {}
        micro, accumulation = config.get("train_micro_batch_size_per_gpu"), config.get("gradient_accumulation_steps")
        print(f"[shunter] deepspeed: ZeRO stage {zero.get('stage', 0)}, micro batch {micro}, accumulation "
              f"{accumulation}, world size {world()[1]}", flush=True)  # fmt: skip
    engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(
        model=model,
        optimizer=client,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        lr_scheduler=scheduler,
        config=config,
        dist_init_required=False,
    )
    return Prepared(
        model=engine,
        module=engine.module,
        optimizer=ds_optimizer,
        strategy=strategy,
        device=here,
        data_loader=data_loader,
        scheduler=ds_scheduler,
        engine=engine,
        gradient_accumulation_steps=int(engine.gradient_accumulation_steps()),
        extra={},
    )
