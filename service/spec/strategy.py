"""The `strategy:` part of the job spec: how the worker group trains (DDP, FSDP, DeepSpeed) and its shared knobs.

Pure pydantic, no torch: the control plane validates it at submission; `workers.strategies` acts on it. Every
combination that would only fail minutes later inside a worker (a ZeRO option that needs another stage, a DeepSpeed
config whose batch sizes contradict the spec, fp16 on CPU) is refused here with the field named.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Any, Literal

from pydantic import ConfigDict, Field, StrictBool, field_validator, model_validator

from service.core.numbers import NoBoolNumbers

AUTO = "auto"
DEFAULT_ZERO_STAGE = 2


class _Strict(NoBoolNumbers):
    # NaN and infinity are not JSON: they would not survive the spec's trip through the database and the driver.
    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False)


def check_finite(value: Any, where: str) -> None:
    """Refuse NaN and infinity anywhere in a JSON-like value (JSON has neither; PostgreSQL refuses them)."""
    stack = [(value, where)]  # a loop, not recursion: a deeply nested body must be a 422, not a RecursionError
    while stack:
        item, path = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            raise ValueError(f"{path}: {item!r} is not a JSON number; give a finite value")
        if isinstance(item, dict):
            stack.extend((v, f"{path}.{k}") for k, v in item.items())
        elif isinstance(item, list | tuple):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(item))


class StrategyKind(str, Enum):
    ddp = "ddp"
    fsdp = "fsdp"
    deepspeed = "deepspeed"


class MixedPrecision(str, Enum):
    no = "no"
    fp16 = "fp16"
    bf16 = "bf16"
    auto = "auto"  # bf16 on GPUs that have it, else fp16 on GPU, else no (CPU)


class FSDPOptions(_Strict):
    sharding: Literal["full_shard", "shard_grad_op", "hybrid_shard"] = "full_shard"
    cpu_offload: StrictBool = False
    activation_checkpointing: StrictBool = False
    wrap_classes: list[str] | None = Field(
        None, description="transformer block class names to shard one by one; found from the model when unset"
    )
    shard_size: int | None = Field(
        None, ge=1, description="hybrid_shard: workers per shard group (default: workers per node)"
    )


class DeepSpeedOptions(_Strict):
    """The short form (the stored fields; None = not given) or a full `config`, never both.

    "Not given" is None in the model, never a filled-in default, so a full dump of the spec validates again as the
    same spec: the defaults (ZeRO stage 2, no offload, no overlap) are applied by the `resolved_*` properties.
    """

    zero_stage: int | None = Field(None, ge=0, le=3, description="ZeRO stage 0-3 (default 2)")
    offload_optimizer: Literal["cpu", "none"] | None = Field(None, description="cpu | none (default none)")
    offload_param: Literal["cpu", "none"] | None = Field(None, description="cpu | none (default none); needs stage 3")
    overlap_comm: StrictBool | None = Field(None, description="default false")
    reduce_bucket_size: int | None = Field(None, gt=0, le=2**40)
    allgather_bucket_size: int | None = Field(None, gt=0, le=2**40)
    config: dict[str, Any] | None = Field(None, description="a full DeepSpeed JSON config, used as is")

    @field_validator("config")
    @classmethod
    def _finite(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        check_finite(value, "strategy.deepspeed.config")
        return value

    @property
    def resolved_zero_stage(self) -> int:
        return DEFAULT_ZERO_STAGE if self.zero_stage is None else self.zero_stage

    @property
    def resolved_offload_optimizer(self) -> Literal["cpu", "none"]:
        return self.offload_optimizer or "none"

    @property
    def resolved_offload_param(self) -> Literal["cpu", "none"]:
        return self.offload_param or "none"

    @property
    def resolved_overlap_comm(self) -> bool:
        return bool(self.overlap_comm)

    @model_validator(mode="after")
    def _coherent(self) -> DeepSpeedOptions:
        if self.config is not None:
            short = sorted(k for k in type(self).model_fields if k != "config" and getattr(self, k) is not None)
            if short:
                raise ValueError(
                    f"give either config (a full DeepSpeed config) or the short form, not both (also set: {short})"
                )
            return self
        if self.resolved_offload_param == "cpu" and self.resolved_zero_stage != 3:
            raise ValueError(f"offload_param: cpu needs zero_stage: 3 (got {self.resolved_zero_stage})")
        if self.resolved_offload_optimizer == "cpu" and self.resolved_zero_stage == 0:
            raise ValueError("offload_optimizer: cpu needs zero_stage 1, 2 or 3 (got 0)")
        return self


def _count(config: dict[str, Any], key: str) -> int | None:
    """A DeepSpeed batch-size value as a positive int; None for "auto" or absent."""
    value = config.get(key)
    if value is None or value == AUTO:
        return None
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())  # not NaN or infinity
    if isinstance(value, bool) or not whole or value < 1:
        raise ValueError(f'strategy.deepspeed.config.{key}: must be a positive integer or "auto", got {value!r}')
    return int(value)


class StrategySpec(_Strict):
    kind: StrategyKind = StrategyKind.ddp
    mixed_precision: MixedPrecision = MixedPrecision.no
    fsdp: FSDPOptions | None = None
    deepspeed: DeepSpeedOptions | None = None
    gradient_accumulation_steps: int | None = Field(
        None, ge=1, le=4096, description="micro-batches per optimizer step (default 1)"
    )
    gradient_clipping: float | None = Field(None, gt=0)
    micro_batch_size: int | None = Field(None, ge=1, le=2**20, description="samples per worker per step")
    scale_lr: Literal["none", "linear"] = "none"
    base_batch_size: int | None = Field(None, ge=1, le=2**30)
    seed: int | None = Field(None, ge=0, le=2**32 - 1, description="numpy takes seeds below 2**32")

    @model_validator(mode="after")
    def _options_match_kind(self) -> StrategySpec:
        if self.fsdp is not None and self.kind is not StrategyKind.fsdp:
            raise ValueError(f"fsdp options given but kind is {self.kind.value}")
        if self.deepspeed is not None and self.kind is not StrategyKind.deepspeed:
            raise ValueError(f"deepspeed options given but kind is {self.kind.value}")
        if self.scale_lr == "linear" and self.base_batch_size is None:
            raise ValueError("scale_lr: linear needs base_batch_size")
        return self

    @property
    def accumulation_steps(self) -> int:
        """Gradient accumulation steps, 1 when not given (a full DeepSpeed config may give its own)."""
        return self.gradient_accumulation_steps or 1

    @property
    def fsdp_options(self) -> FSDPOptions:
        return self.fsdp or FSDPOptions()

    @property
    def deepspeed_options(self) -> DeepSpeedOptions:
        return self.deepspeed or DeepSpeedOptions()

    def resolved_mixed_precision(self, *, use_gpu: bool, bf16_supported: bool = True) -> MixedPrecision:
        """What `auto` means on this hardware: bf16 where the GPU has it, fp16 on older GPUs, none on CPU."""
        if self.mixed_precision is not MixedPrecision.auto:
            return self.mixed_precision
        if not use_gpu:
            return MixedPrecision.no
        return MixedPrecision.bf16 if bf16_supported else MixedPrecision.fp16

    def check_against(self, *, use_gpu: bool, num_workers: int) -> None:
        """Cross-field checks that need the resources part of the spec."""
        if not use_gpu and self.mixed_precision in (MixedPrecision.fp16, MixedPrecision.bf16):
            raise ValueError(
                f"strategy.mixed_precision={self.mixed_precision.value} needs GPUs (resources.use_gpu: true); "
                "use 'no', or 'auto' to fall back on CPU"
            )
        if self.kind is StrategyKind.fsdp:
            self._check_fsdp(num_workers=num_workers)
        if self.kind is StrategyKind.deepspeed and self.deepspeed and self.deepspeed.config is not None:
            self._check_deepspeed_config(self.deepspeed.config, use_gpu=use_gpu, num_workers=num_workers)

    def _check_fsdp(self, *, num_workers: int) -> None:
        options = self.fsdp_options
        if options.sharding == "hybrid_shard":
            if num_workers < 2:
                raise ValueError("strategy.fsdp.sharding: hybrid_shard needs at least 2 workers")
            if options.shard_size is not None and num_workers % options.shard_size:
                raise ValueError(
                    f"strategy.fsdp.shard_size: {options.shard_size} does not divide resources.num_workers "
                    f"({num_workers}); hybrid_shard replicates whole shard groups"
                )
        elif options.shard_size is not None:
            raise ValueError("strategy.fsdp.shard_size: only meaningful with sharding: hybrid_shard")

    def _check_deepspeed_config(self, config: dict[str, Any], *, use_gpu: bool, num_workers: int) -> None:
        """A full DeepSpeed config must agree with the spec; "auto" values are filled from the spec at run time."""
        where = "strategy.deepspeed.config"
        micro = _count(config, "train_micro_batch_size_per_gpu")
        accum = _count(config, "gradient_accumulation_steps")
        total = _count(config, "train_batch_size")
        if micro is not None and self.micro_batch_size is not None and micro != self.micro_batch_size:
            raise ValueError(
                f"{where}.train_micro_batch_size_per_gpu: {micro} contradicts strategy.micro_batch_size "
                f'({self.micro_batch_size}); set one of them, or "auto"'
            )
        spec_accum = self.gradient_accumulation_steps
        if accum is not None and spec_accum is not None and accum != spec_accum:
            raise ValueError(
                f"{where}.gradient_accumulation_steps: {accum} contradicts strategy.gradient_accumulation_steps "
                f'({self.gradient_accumulation_steps}); set one of them, or "auto"'
            )
        micro = micro if micro is not None else self.micro_batch_size
        accum = accum if accum is not None else self.accumulation_steps
        if total is not None and micro is not None and total != micro * accum * num_workers:
            raise ValueError(
                f"{where}.train_batch_size: {total} != micro batch {micro} x gradient accumulation {accum} x "
                f"{num_workers} workers = {micro * accum * num_workers}"
            )
        if total is not None and micro is None and total % (accum * num_workers):
            raise ValueError(
                f"{where}.train_batch_size: {total} is not divisible by gradient accumulation {accum} x "
                f"{num_workers} workers"
            )
        clip = config.get("gradient_clipping")
        if clip not in (None, AUTO) and self.gradient_clipping is not None and clip != self.gradient_clipping:
            raise ValueError(
                f"{where}.gradient_clipping: {clip} contradicts strategy.gradient_clipping ({self.gradient_clipping})"
            )
        enabled = [k for k in ("fp16", "bf16") if isinstance(config.get(k), dict) and config[k].get("enabled") is True]
        if len(enabled) > 1:
            raise ValueError(f"{where}: fp16 and bf16 cannot both be enabled")
        if enabled and not use_gpu:
            raise ValueError(
                f"{where}.{enabled[0]}.enabled: {enabled[0]} needs GPUs (resources.use_gpu: true); "
                'use "auto" to follow strategy.mixed_precision'
            )
        zero = config.get("zero_optimization") or {}
        if not isinstance(zero, dict):
            raise ValueError(f"{where}.zero_optimization: must be a mapping")
        stage = zero.get("stage", 0)
        if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
            raise ValueError(f"{where}.zero_optimization.stage: must be 0-3, got {stage!r}")
        if _device(zero.get("offload_param")) not in (None, "none") and stage != 3:
            raise ValueError(f"{where}.zero_optimization.offload_param: needs stage 3 (got {stage})")
        if _device(zero.get("offload_optimizer")) not in (None, "none") and stage == 0:
            raise ValueError(f"{where}.zero_optimization.offload_optimizer: needs stage 1, 2 or 3 (got 0)")
        if not use_gpu and _device(zero.get("offload_param")) == "nvme":
            raise ValueError(f"{where}.zero_optimization.offload_param: nvme offload needs GPUs")


def _device(offload: Any) -> str | None:
    if isinstance(offload, dict):
        return offload.get("device")
    return None
