"""The train session a loop's model, data, reports and checkpoints go through: Ray Train's, or a local one.

The strategies (`workers.strategies`), the checkpoint helpers and the recipes never call `ray.train` themselves:
they call this module. Inside a Ray Train worker (every shunter job) it is `ray.train` and `ray.train.torch`. A
process that `torchrun` started with SHUNTER_LOCAL_RUN_DIR set, after `start_local()`, gets a local session instead:

- the process group from torchrun's environment (NCCL when CUDA is there, else gloo), one device per local rank;
- DDP at every world size (so a one-GPU run still goes through NCCL's all-reduce), loaders with a
  `DistributedSampler` whose batches are moved to the device, as Ray's `prepare_data_loader` does;
- each report a line of `<run dir>/metrics.jsonl` (from rank 0), each checkpoint a `checkpoint-step*` folder of the
  run directory that every rank writes its part into (the run directory must be one every rank sees), and the latest
  complete one is what `get_checkpoint()` resumes from, as Ray Train's would after a restart.

That is how the GPU tier (`tests/gpu/`) runs the strategies on a machine with no Ray, and how a user can debug a
train loop under plain `torchrun` exactly as shunter would run it.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from workers.ranks import barrier, world

ENV_LOCAL_RUN = "SHUNTER_LOCAL_RUN_DIR"
METRICS = "metrics.jsonl"
PARTIAL = ".partial-"  # a checkpoint folder being written: never resumed from


def local_dir() -> Path | None:
    """The local session's run directory, or None under Ray Train (the variable unset)."""
    value = os.environ.get(ENV_LOCAL_RUN)
    return Path(value) if value else None


def start_local(run_dir: str | Path | None = None) -> torch.device:
    """Begin a local session in a process torchrun started: the process group from its environment, this rank's
    device, and the run directory (default SHUNTER_LOCAL_RUN_DIR). Returns the device."""
    if run_dir is not None:
        os.environ[ENV_LOCAL_RUN] = str(run_dir)
    directory = local_dir()
    if directory is None:
        raise RuntimeError(f"{ENV_LOCAL_RUN}: no run directory for the local session")
    directory.mkdir(parents=True, exist_ok=True)
    here = device()
    if not dist.is_initialized():
        if here.type == "cuda":
            torch.cuda.set_device(here)
        dist.init_process_group(backend="nccl" if here.type == "cuda" else "gloo")
    return here


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def device() -> torch.device:
    """This worker's device: the one Ray Train gave it, or in a local session the GPU of its local rank (else CPU)."""
    if local_dir() is None:
        with suppress(Exception):  # outside a Ray Train worker (a unit test calling a strategy directly)
            from ray.train.torch import get_device

            return get_device()
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def local_world_size() -> int:
    if local_dir() is not None:
        return int(os.environ.get("LOCAL_WORLD_SIZE", world()[1]))
    try:
        import ray.train

        return int(ray.train.get_context().get_local_world_size())
    except Exception:  # outside a Ray Train worker: one process per node is the safe guess
        return world()[1]


def prepare_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model on this worker's device, wrapped for DDP (Ray's `prepare_model`, or DDP at every size locally)."""
    if local_dir() is None:
        import ray.train.torch

        return ray.train.torch.prepare_model(model, parallel_strategy="ddp")
    here = device()
    model = model.to(here)
    if here.type == "cuda":
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=[here.index], output_device=here.index)
    return torch.nn.parallel.DistributedDataParallel(model)


def prepare_data_loader(data_loader: Any) -> Any:
    """Ray's `prepare_data_loader`, or locally the same: a `DistributedSampler` over the world, batches on the device.

    Locally the caller (`workers.strategies.common.distributed_loader`) has already given a plain loader its
    `DistributedSampler`; what is left is moving batches to the device."""
    if local_dir() is None:
        import ray.train.torch

        return ray.train.torch.prepare_data_loader(data_loader)
    return OnDevice(data_loader, device())


class OnDevice:
    """A loader whose batches (tensors, or lists, tuples and dicts of them) arrive on `device`; the rest of the
    loader (sampler, batch_size, dataset, len) reads through."""

    def __init__(self, loader: Any, here: torch.device) -> None:
        self.loader, self.device = loader, here

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Any:
        for batch in self.loader:
            yield _moved(batch, self.device)


def _moved(value: Any, here: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(here, non_blocking=True)
    if isinstance(value, tuple | list):
        return type(value)(_moved(item, here) for item in value)
    if isinstance(value, dict):
        return {key: _moved(item, here) for key, item in value.items()}
    return value


def get_checkpoint() -> Any:
    """What this run resumes from: Ray Train's latest checkpoint, or locally the newest complete `checkpoint-step*`
    folder of the run directory (a Path), None when there is none."""
    directory = local_dir()
    if directory is None:
        import ray.train

        return ray.train.get_checkpoint()
    done = sorted(p for p in directory.glob("checkpoint-*") if p.is_dir())
    return done[-1] if done else None


def report(metrics: dict[str, Any], *, checkpoint_dir: Path | None = None, name: str | None = None) -> None:
    """`ray.train.report` from every rank, with this rank's part of the checkpoint in `checkpoint_dir`; locally the
    parts of every rank are merged into `<run dir>/<name>` (collective: every rank calls it) and rank 0 appends the
    metrics to `metrics.jsonl`."""
    directory = local_dir()
    if directory is None:
        import ray.train

        if checkpoint_dir is None:
            ray.train.report(metrics)
        else:
            checkpoint = ray.train.Checkpoint.from_directory(str(checkpoint_dir))
            ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=name)
        return
    rank, _ = world()
    line = {**metrics, "reported_at": time.time()}
    if checkpoint_dir is not None:
        if not name:
            raise ValueError("a local checkpoint needs its folder's name")
        partial = directory / f"{PARTIAL}{name}"
        if rank == 0 and partial.exists():  # left by a run that died while writing it
            shutil.rmtree(partial)
        barrier()
        shutil.copytree(checkpoint_dir, partial, dirs_exist_ok=True)
        barrier()
        if rank == 0:
            final = directory / name
            if final.exists():  # written again at the same step (a resumed run): the newer one wins
                shutil.rmtree(final)
            partial.rename(final)
        barrier()
        line["checkpoint"] = name
    if rank == 0:
        with (directory / METRICS).open("a") as out:
            out.write(json.dumps(line, default=float) + "\n")


def reported(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every report of a local session's run, in order."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def storage() -> tuple[str, Any]:
    """(path, pyarrow filesystem or None for local) of the run's own folder: Ray Train's experiment folder, or the
    local session's run directory."""
    directory = local_dir()
    if directory is not None:
        return str(directory), None
    import ray.train

    context = ray.train.get_context().get_storage()
    return context.experiment_fs_path, context.storage_filesystem
