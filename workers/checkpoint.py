"""shunter's checkpoints: model, optimizer, scheduler, step/epoch and every rank's RNG, sealed by a manifest.

Every rank writes what it owns into its own local folder (DDP: rank 0 the unwrapped state; FSDP2: each rank its
DCP shard; DeepSpeed: `engine.save_checkpoint`), and Ray Train merges all folders into one checkpoint. Rank 0
writes `shunter-manifest.json` last, listing every rank's files with size and sha256 (`workers.manifest`: its format
and the completeness rule). `load` refuses a checkpoint that rule calls incomplete (a crash mid-save, a partial
upload), and one without shunter's state file, which user code wrote and which holds nothing `load` can restore.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from service.spec.strategy import StrategyKind
from workers import manifest
from workers.context import ENV_ATTEMPT, STRATEGY_METRIC
from workers.manifest import MANIFEST, STATE
from workers.proof import prove_checkpoint, recorded_manifest
from workers.ranks import barrier, world
from workers.rng_state import rng_state, set_rng_state


class Prepared(Protocol):
    """What saving and loading a checkpoint reads and sets of a prepared run (`workers.strategies.common.Prepared`,
    named here by what is used, so that this module needs nothing of the strategies that call it)."""

    model: Any
    module: torch.nn.Module
    optimizer: Any
    scheduler: Any
    engine: Any
    scaler: Any
    device: torch.device
    step: int
    epoch: int
    batch_in_epoch: int
    extra: dict[str, Any]

    @property
    def kind(self) -> StrategyKind: ...

    @property
    def batch_size(self) -> int | None: ...

    def samples_in_epoch(self) -> int | None: ...

    def resume_at(self, *, step: int, epoch: int, batch_in_epoch: int) -> None: ...


log = logging.getLogger(__name__)
DEEPSPEED_DIR, DEEPSPEED_TAG = "deepspeed", "shunter"
DCP_DIR = "dcp"
ENV_RESUME_FROM = "SHUNTER_RESUME_FROM"  # a checkpoint path/URI a new run starts from


class IncompleteCheckpointError(RuntimeError):
    """`load` refuses the checkpoint: incomplete by `workers.manifest.check`, or not written by shunter's helpers."""


class NotShunterCheckpointError(IncompleteCheckpointError):
    """Complete as Ray Train reported it, but written by user code: it has no shunter state for `load` to restore."""


def _gather(value: Any) -> list[Any]:
    rank, size = world()
    if size == 1:
        return [value]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, value)
    return out


def rng_file(rank: int) -> str:
    return f"rng-rank{rank}.json"


def save(prepared: Prepared, directory: str | Path) -> Path:
    """Write this rank's part of a checkpoint into `directory` (call on every rank; collective)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rank, size = world()
    kind = prepared.kind
    if kind is StrategyKind.deepspeed:
        from deepspeed.checkpoint.constants import (
            UNIVERSAL_CHECKPOINT_INFO,
            UNIVERSAL_CHECKPOINT_VERSION_KEY,
            UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        )

        # What `ds_to_universal` needs to turn it into a checkpoint of any world size (Megatron writes the same).
        info = {UNIVERSAL_CHECKPOINT_INFO: {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}}
        prepared.engine.save_checkpoint(str(directory / DEEPSPEED_DIR), tag=DEEPSPEED_TAG, client_state=info)
    elif kind is StrategyKind.fsdp:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(prepared.model, prepared.optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(directory / DCP_DIR))
    elif rank == 0:
        torch.save(prepared.module.state_dict(), directory / "model.pt")
        torch.save(prepared.optimizer.state_dict(), directory / "optimizer.pt")
    if rank == 0 and kind is not StrategyKind.deepspeed:  # DeepSpeed saves its scheduler itself
        if prepared.scheduler is not None:
            torch.save(prepared.scheduler.state_dict(), directory / "scheduler.pt")
        if prepared.scaler is not None:
            torch.save(prepared.scaler.state_dict(), directory / "scaler.pt")
    (directory / rng_file(rank)).write_text(json.dumps(rng_state()))
    state = {
        "step": prepared.step,
        "epoch": prepared.epoch,
        "batch_in_epoch": prepared.batch_in_epoch,
        "samples_in_epoch": prepared.samples_in_epoch(),
        "batch_size": prepared.batch_size,
        "strategy": kind.value,
        "world_size": size,
        "extra": prepared.extra,
    }
    if rank == 0:
        (directory / STATE).write_text(json.dumps(state, indent=1))
    # The manifest comes last and covers every rank's files: only a fully written checkpoint gets one.
    listings = _gather(manifest.listing(directory))
    if rank == 0:
        files: dict[str, dict[str, Any]] = {}
        for listing in listings:
            for name, entry in listing.items():
                if name in files and files[name]["sha256"] != entry["sha256"]:
                    raise RuntimeError(f"checkpoint file {name} written differently by two ranks")
                files[name] = entry
        attempt = os.environ.get(ENV_ATTEMPT)
        manifest.write(directory, files, step=prepared.step, epoch=prepared.epoch,
                       attempt=int(attempt) if attempt and attempt.isdigit() else None)  # fmt: skip
    return directory


def verify(directory: str | Path, *, uri: str | None = None, recorded: str | None = None) -> dict[str, Any]:
    """The manifest of a complete checkpoint written by shunter's helpers, every file's sha256 checked.

    Raises IncompleteCheckpointError when `workers.manifest.check` finds it incomplete, and NotShunterCheckpointError
    for a checkpoint user code wrote (no state file, no manifest): complete, but nothing `load` can restore. With
    `recorded` (the sha256 of its manifest the service kept when its attempt reported checkpoint `uri`), the manifest
    must be that one too: `workers.proof.StorageTampered` otherwise, and for any file that does not match it then.
    """
    if recorded is not None:
        proven = prove_checkpoint(str(directory), uri=uri or str(directory), recorded=recorded)
        if proven is not None:
            return proven
    verdict = manifest.check(str(directory), checksums=True)
    if not verdict.complete:
        raise IncompleteCheckpointError(verdict.reason)
    if verdict.manifest is None:
        raise NotShunterCheckpointError(
            f"{directory}: no {STATE} and no {MANIFEST}; written by user code, not by shunter's checkpoint helpers"
        )
    return verdict.manifest


def resume_point(resume_from: Any = None) -> Any:
    """What to resume from: this run's latest checkpoint (a restarted worker group, or a new attempt reusing the
    run name) wins; else `resume_from` (a ray.train.Checkpoint, path or URI); else env SHUNTER_RESUME_FROM."""
    from workers import session

    latest = session.get_checkpoint()
    if latest is not None:
        return latest
    if resume_from is None:
        resume_from = os.environ.get(ENV_RESUME_FROM) or None
    if isinstance(resume_from, str | Path):
        from workers.storage import checkpoint_at

        return checkpoint_at(str(resume_from))  # an s3:// URI needs shunter's endpoint settings to be reachable
    return resume_from


def load(prepared: Prepared, checkpoint: Any = None) -> bool:
    """Restore from `checkpoint` (a ray.train.Checkpoint, path or URI), default `resume_point()`.

    Collective: call on every rank. Returns False when there is nothing to resume from.
    """
    checkpoint = resume_point(checkpoint)
    if checkpoint is None:
        return False
    if isinstance(checkpoint, str | Path):
        uri = str(checkpoint)
        _load_dir(prepared, Path(checkpoint), uri=uri, recorded=recorded_manifest(uri))
    else:
        from workers.progress import checkpoint_uri_of

        uri = checkpoint_uri_of(checkpoint)
        recorded = recorded_manifest(uri)
        with checkpoint.as_directory() as local:  # what is proven is the copy that is loaded
            _load_dir(prepared, Path(local), uri=uri, recorded=recorded)
    log.info("resumed at step %d (epoch %d)", prepared.step, prepared.epoch)
    return True


def _load_dir(prepared: Prepared, directory: Path, *, uri: str | None = None, recorded: str | None = None) -> None:
    verify(directory, uri=uri, recorded=recorded)
    state = json.loads((directory / STATE).read_text())
    if state["strategy"] != prepared.kind.value:
        raise IncompleteCheckpointError(
            f"{directory}: written by strategy {state['strategy']}, cannot resume under {prepared.kind.value}"
        )
    rank, size = world()
    saved = state.get("world_size")
    resized = saved is not None and saved != size
    kind = prepared.kind
    if kind is StrategyKind.deepspeed:
        if resized:
            _load_deepspeed_resized(prepared, directory / DEEPSPEED_DIR, saved)
        else:
            path, _ = prepared.engine.load_checkpoint(str(directory / DEEPSPEED_DIR), tag=DEEPSPEED_TAG)
            if path is None:
                raise IncompleteCheckpointError(f"{directory}: DeepSpeed could not load its checkpoint")
    elif kind is StrategyKind.fsdp:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optim_state = get_state_dict(prepared.model, prepared.optimizer)
        target: dict[str, Any] = {"model": model_state, "optim": optim_state}
        dcp.load(target, checkpoint_id=str(directory / DCP_DIR))
        set_state_dict(
            prepared.model, prepared.optimizer, model_state_dict=target["model"], optim_state_dict=target["optim"]
        )
    else:
        # weights_only: tensors and plain containers only, whatever torch's default is; nothing in storage runs code.
        model = torch.load(directory / "model.pt", map_location=prepared.device, weights_only=True)
        prepared.module.load_state_dict(model)
        optim = torch.load(directory / "optimizer.pt", map_location=prepared.device, weights_only=True)
        prepared.optimizer.load_state_dict(optim)
    if kind is not StrategyKind.deepspeed:
        if prepared.scheduler is not None and (directory / "scheduler.pt").is_file():
            prepared.scheduler.load_state_dict(torch.load(directory / "scheduler.pt", weights_only=True))
        if prepared.scaler is not None and (directory / "scaler.pt").is_file():
            prepared.scaler.load_state_dict(torch.load(directory / "scaler.pt", weights_only=True))
    _restore_rng(directory, rank)
    skip = skip_for(state, prepared.batch_size, size)
    if resized and rank == 0:
        log.info("resuming at world size %d from a checkpoint written at %d: %s samples of epoch %d read, %d batches "
                 "skipped per rank", size, saved, state.get("samples_in_epoch"), state["epoch"],
                 skip)  # fmt: skip
    prepared.resume_at(step=state["step"], epoch=state["epoch"], batch_in_epoch=skip)
    prepared.extra.update(state.get("extra") or {})


def _load_deepspeed_resized(prepared: Prepared, source: Path, saved_world: int) -> None:
    """Load a DeepSpeed checkpoint written at another data-parallel size: ZeRO's partitions are per rank, and
    `load_checkpoint` refuses another size ("Automatic adjustment of ZeRO's optimizer state partitioning with a new
    world size is not currently supported"). DeepSpeed's universal checkpoint is the way across: `ds_to_universal`
    turns the partitions into one fp32 tensor per parameter (with its optimizer moments), which
    `load_checkpoint` with `checkpoint.load_universal` re-partitions for this size, ZeRO 1, 2 and 3 alike. One rank
    per machine converts, into a folder on that machine the others of it read; it is removed once all have loaded."""
    import argparse
    import contextlib
    import io
    import socket

    from deepspeed.checkpoint import ds_to_universal

    rank, size = world()
    token = _gather(os.urandom(8).hex() if rank == 0 else None)[0]
    hosts = _gather(socket.gethostname())
    converts = hosts.index(hosts[rank]) == rank  # the first rank of each machine
    target = Path(tempfile.gettempdir(), f"shunter-ds-universal-{token}")
    try:
        if converts:
            args = argparse.Namespace(
                input_folder=str(source / DEEPSPEED_TAG), output_folder=str(target / DEEPSPEED_TAG),
                num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                inject_missing_state=True,  # checkpoints written before shunter saved universal_checkpoint_info
            )  # fmt: skip
            with contextlib.redirect_stdout(io.StringIO()):
                ds_to_universal.main(args)
            (target / "latest_universal").write_text(DEEPSPEED_TAG)
        barrier()
        engine = prepared.engine
        engine._config.load_universal_checkpoint = True
        try:
            path, _ = engine.load_checkpoint(str(target), tag=DEEPSPEED_TAG)
        finally:
            engine._config.load_universal_checkpoint = False  # what it saves from here on is a plain checkpoint
        if path is None:
            raise IncompleteCheckpointError(f"{source}: DeepSpeed could not load its universal checkpoint")
        if rank == 0:
            log.info("DeepSpeed checkpoint of %d ranks re-partitioned for %d through a universal checkpoint",
                     saved_world, size)  # fmt: skip
    finally:
        barrier()
        if converts:
            shutil.rmtree(target, ignore_errors=True)


def skip_for(state: dict[str, Any], batch_size: int | None, world_size: int) -> int:
    """How many batches of this epoch each rank skips on resuming from a checkpoint's `state`.

    At the size it was written at: the batches each rank had read. At another: the global samples it had read
    (`samples_in_epoch`, the first ones of the epoch's permutation, see `distributed_loader`), in whole batches of the
    new size, rounded down: no sample is skipped, and fewer than one batch per rank is read twice."""
    batches = int(state.get("batch_in_epoch") or 0)
    samples = state.get("samples_in_epoch")
    if state.get("world_size") in (None, world_size) or samples is None or not batch_size:
        return batches
    return int(samples) // (batch_size * world_size)


def _restore_rng(directory: Path, rank: int) -> None:
    rng = directory / rng_file(rank)
    if rng.is_file():
        set_rng_state(json.loads(rng.read_text()))
    elif (directory / f"rng-rank{rank}.pkl").is_file():
        # Written by an older release with pickle: unpickling a file from shared storage could run any code.
        log.warning("%s: RNG state in the old pickle format is not loaded; rank %d keeps a fresh RNG", directory, rank)
    # Neither: the world size grew since; those ranks keep their fresh RNG.


def report(prepared: Prepared, metrics: dict[str, Any], *, checkpoint: bool = False) -> None:
    """`ray.train.report` from every rank, with this rank's part of a checkpoint when asked.

    Every report carries the strategy `prepare` applied (`STRATEGY_METRIC`), so the driver can tell a job whose train
    loop applied the spec's strategy from one that ran as plain Ray Train code (see `workers.progress`).
    """
    from workers import session

    metrics = {**metrics, STRATEGY_METRIC: prepared.kind.value}
    if not checkpoint:
        session.report(metrics)
        return
    local = Path(tempfile.mkdtemp(prefix="shunter-ckpt-"))
    try:
        save(prepared, local)
        session.report(metrics, checkpoint_dir=local, name=f"checkpoint-step{prepared.step:08d}")
    finally:
        shutil.rmtree(local, ignore_errors=True)


def full_state_dict(prepared: Prepared) -> dict[str, torch.Tensor] | None:
    """The whole unsharded model state on CPU at rank 0 (None elsewhere); collective for FSDP and ZeRO-3."""
    rank, _ = world()
    kind = prepared.kind
    if kind is StrategyKind.fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state: dict[str, Any] | None = get_model_state_dict(
            prepared.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        return state if rank == 0 else None
    if kind is StrategyKind.deepspeed and prepared.engine.zero_optimization_stage() == 3:
        import deepspeed

        module = prepared.module
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            state = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()} if rank == 0 else None
        return state
    if rank != 0:
        return None
    return {k: v.detach().cpu().clone() for k, v in prepared.module.state_dict().items()}
