"""What every strategy shares: the prepared training state and its optimizer-step logic.

`Prepared` is the one object a train loop talks to, whatever the strategy: it owns gradient accumulation,
clipping, the fp16 GradScaler, the global step counter (which checkpoints save and resumes restore) and
reporting to Ray Train. The strategy modules only build it.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from service.spec.strategy import MixedPrecision, StrategyKind, StrategySpec
from workers import session
from workers.ranks import world
from workers.session import device, local_world_size  # noqa: F401 - the strategies' own names for them

log = logging.getLogger(__name__)

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


def current_strategy(strategy: StrategySpec | None = None) -> StrategySpec:
    """The explicit strategy if given, else the one of the shunter job this process runs in (DDP outside shunter)."""
    if strategy is not None:
        return strategy
    from workers.context import job_spec

    return job_spec().strategy


def uses_gpu() -> bool:
    return device().type == "cuda"


def mixed_precision(strategy: StrategySpec) -> MixedPrecision:
    """The precision actually used here: `auto` becomes bf16/fp16 on GPUs and `no` on CPU."""
    gpu = uses_gpu()
    return strategy.resolved_mixed_precision(use_gpu=gpu, bf16_supported=gpu and torch.cuda.is_bf16_supported())


def low_precision_dtype(precision: MixedPrecision) -> torch.dtype | None:
    return {MixedPrecision.bf16: torch.bfloat16, MixedPrecision.fp16: torch.float16}.get(precision)


def seed_everything(seed: int | None = None, *, strategy: StrategySpec | None = None) -> int | None:
    """Seed python, numpy and torch alike on every rank, so every rank builds the same initial model."""
    seed = seed if seed is not None else current_strategy(strategy).seed
    if seed is None:
        return None
    random.seed(seed)
    with contextlib.suppress(ImportError):
        import numpy as np

        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    return seed


def scale_lr(optimizer: torch.optim.Optimizer, strategy: StrategySpec, *, micro_batch_size: int | None) -> float:
    """Apply the linear scaling rule (lr x effective batch / base batch) in place; returns the factor used."""
    if strategy.scale_lr != "linear" or strategy.base_batch_size is None:
        return 1.0
    micro = strategy.micro_batch_size or micro_batch_size
    if micro is None:
        raise ValueError("strategy.scale_lr: linear needs strategy.micro_batch_size or a data loader with a batch size")
    effective = micro * strategy.accumulation_steps * world()[1]
    factor = effective / strategy.base_batch_size
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * factor
        group["initial_lr"] = group["lr"]
    log.info("linear LR scaling: effective batch %d / base %d = x%.3g", effective, strategy.base_batch_size, factor)
    return factor


def distributed_loader(data_loader: Any) -> Any:
    """Ray Train's `prepare_data_loader` (or a local session's, `workers.session`), with a `DistributedSampler` at one
    worker too.

    Ray adds the sampler only above one worker; at one, a shuffling loader keeps its `RandomSampler`, whose order has
    nothing to do with the one the job saw at two workers. With a `DistributedSampler` at every size, the permutation
    of an epoch is the same whatever the world size (`seed + epoch`), and each rank reads every world-size-th element
    of it: a job resumed at another size can skip exactly the samples it has seen (see `Prepared.resume_at`). A loader
    with a sampler of the user's own, or over an `IterableDataset`, is left as Ray leaves it.
    """
    from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

    rank, size = world()
    if (
        isinstance(data_loader, DataLoader)
        and (size == 1 or session.local_dir() is not None)  # Ray adds the sampler above one worker; locally, we do
        and type(data_loader.sampler) in (RandomSampler, SequentialSampler)
        and not isinstance(data_loader.dataset, IterableDataset)
        and data_loader.batch_size is not None
    ):
        loader = data_loader
        extra: dict[str, Any] = {}
        if loader.num_workers > 0:
            extra = {"prefetch_factor": loader.prefetch_factor, "persistent_workers": loader.persistent_workers}
        sampler: DistributedSampler[Any] = DistributedSampler(loader.dataset, num_replicas=size, rank=rank,
                                     shuffle=isinstance(loader.sampler, RandomSampler))  # fmt: skip
        data_loader = DataLoader(
            loader.dataset, batch_size=loader.batch_size, sampler=sampler, num_workers=loader.num_workers,
            collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, drop_last=loader.drop_last,
            timeout=loader.timeout, worker_init_fn=loader.worker_init_fn, generator=loader.generator, **extra,
        )  # fmt: skip
    return session.prepare_data_loader(data_loader)


def build_optimizer(
    optimizer: torch.optim.Optimizer | OptimizerFactory, parameters: Iterable[torch.nn.Parameter]
) -> torch.optim.Optimizer:
    """An optimizer over `parameters`: call a factory, or rebuild a given optimizer (its class and defaults).

    FSDP replaces the parameters with sharded ones, so an optimizer built before wrapping would hold stale tensors.
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        return type(optimizer)(parameters, **optimizer.defaults)
    return optimizer(parameters)


@dataclass
class Prepared:
    """A model, optimizer and data loader ready for one strategy, and the progress of training them."""

    model: Any  # the wrapped model to call: DDP, an FSDP2 module, or a DeepSpeed engine
    module: torch.nn.Module  # the user's module underneath
    optimizer: Any
    strategy: StrategySpec
    device: torch.device
    data_loader: Any = None
    scheduler: Any = None
    engine: Any = None  # the DeepSpeed engine, when kind is deepspeed
    scaler: Any = None  # a GradScaler for fp16 outside DeepSpeed
    autocast_dtype: torch.dtype | None = None
    gradient_accumulation_steps: int = 1
    step: int = 0  # optimizer steps taken, across restarts
    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches consumed in the current epoch
    micro_step: int = 0
    skipped_steps: int = 0  # optimizer steps the fp16 GradScaler dropped (inf/NaN gradients); counted in `step` too
    extra: dict[str, Any] = field(default_factory=dict)  # user state saved with checkpoints (JSON-serialisable)
    _skip_batches: int = 0

    @property
    def kind(self) -> StrategyKind:
        return self.strategy.kind

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Autocast for DDP on GPU; FSDP's MixedPrecisionPolicy and DeepSpeed cast on their own."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def epochs(self, num_epochs: int) -> Iterator[int]:
        """Epoch numbers still to run: a resumed run starts at the epoch its checkpoint was in."""
        for epoch in range(self.epoch, num_epochs):
            if epoch != self.epoch:
                self.batch_in_epoch = 0
            self.epoch = epoch
            yield epoch
        self.epoch, self.batch_in_epoch = num_epochs, 0

    def batches(self) -> Iterator[Any]:
        """This epoch's batches (sampler reshuffled per epoch), skipping those a resumed checkpoint already saw."""
        loader = self.data_loader
        sampler = getattr(loader, "sampler", None)
        if sampler is not None and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.epoch)
        skip, self._skip_batches = self._skip_batches, 0
        for index, batch in enumerate(loader):
            if index < skip:
                continue
            self.batch_in_epoch = index + 1
            yield batch

    @property
    def batch_size(self) -> int | None:
        """Samples per micro-batch on each rank (None when the loader does not say)."""
        size = getattr(self.data_loader, "batch_size", None)
        return int(size) if isinstance(size, int) else None

    def samples_in_epoch(self) -> int | None:
        """Samples every rank together has read this epoch: the first ones of the epoch's permutation."""
        size = self.batch_size
        return None if size is None else self.batch_in_epoch * size * world()[1]

    def resume_at(self, *, step: int, epoch: int, batch_in_epoch: int) -> None:
        self.step, self.epoch, self.batch_in_epoch = step, epoch, batch_in_epoch
        self.micro_step = step * self.gradient_accumulation_steps
        self._skip_batches = batch_in_epoch

    def backward(self, loss: torch.Tensor) -> bool:
        """Backward one micro-batch; on an accumulation boundary clip, step and zero. True when a step was taken."""
        if self.engine is not None:
            boundary = self.engine.is_gradient_accumulation_boundary()
            self.engine.backward(loss)
            self.engine.step()  # DeepSpeed counts micro-steps itself and only updates on the boundary
            self.micro_step += 1
            if boundary:
                self.step += 1
            return bool(boundary)
        self.micro_step += 1
        boundary = self.micro_step % self.gradient_accumulation_steps == 0
        self._set_gradient_sync(boundary)
        scaled = loss / self.gradient_accumulation_steps
        (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        if not boundary:
            return False
        if self.strategy.gradient_clipping:
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.strategy.gradient_clipping)
        skipped = False
        if self.scaler is not None:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)  # skips the update when the gradients hold an inf or a NaN
            self.scaler.update()
            skipped = self.scaler.get_scale() < scale  # the scale falls exactly when the step was skipped
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if skipped:
            self.skipped_steps += 1  # the schedule waits for an update that happened (torch warns otherwise)
        elif self.scheduler is not None:
            self.scheduler.step()
        self.step += 1
        return True

    def _set_gradient_sync(self, sync: bool) -> None:
        # Skipping the all-reduce on accumulation micro-steps is the point of accumulating.
        if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2
            self.model.set_requires_gradient_sync(sync)
        elif hasattr(self.model, "require_backward_grad_sync"):  # DDP
            self.model.require_backward_grad_sync = sync

    def metrics(self, **values: Any) -> dict[str, Any]:
        """Metrics with shunter's standard keys (step, epoch, lr) filled in."""
        out: dict[str, Any] = {"step": self.step, "epoch": self.epoch, "lr": self.lr}
        for key, value in values.items():
            out[key] = value.item() if isinstance(value, torch.Tensor) else value
        return out

    def report(self, metrics: dict[str, Any] | None = None, *, checkpoint: bool = False, **values: Any) -> None:
        """Report to Ray Train from every rank (V2 needs all), with a full checkpoint when asked, when the job has
        been asked to make room for a higher-priority one (`workers.preemption`), or when a node of this attempt is
        draining (`workers.drain`): then, once the checkpoint is written, the attempt stops here (`NodeDraining`)."""
        from workers import drain, preemption
        from workers.checkpoint import report

        yielding = preemption.requested()
        notice = drain.notice()
        report(self, self.metrics(**(metrics or {}), **values), checkpoint=checkpoint or yielding or notice is not None)
        if notice is not None:
            raise drain.NodeDraining(notice, self.step)
        if yielding:
            preemption.hold()  # trained past this checkpoint, a step would only be lost when the dispatcher stops it


def broadcast_module(module: torch.nn.Module) -> None:
    """Make every rank hold rank 0's weights: sharding wrappers shard each rank's local copy as it is."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor.data, src=0)
