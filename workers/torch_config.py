"""Ray Train's `TorchConfig` less its import of torch in the controller.

Ray Train's controller is told how to set up the workers' process group by the trainer's `TorchConfig`, which it
unpickles. `ray.train.torch.config` imports torch at its top, so every attempt's controller imported torch (~1.9
CPU-seconds on the 2-core CI machine, and ~300 MB held for the life of the job) only to send functions to the workers.

`LeanTorchConfig` is the same configuration in a module without torch. Its backend calls Ray's own worker-side
functions by name, on the workers, where torch is imported anyway; the device set-up around the train loop is Ray's own
context manager, made on the worker. Only the controller's part of Ray's `_TorchBackend.on_start` is written again here
(the rendezvous address, then the process group on every rank), without its TPU branch: shunter asks Ray for CPUs and
GPUs only. The rendezvous is rank 0's store, bound to a port the kernel gives it (`_listen`), not a port probed free
and bound later, which another process can take in between. A Ray that renamed one of the functions gets Ray's own
`TorchConfig` (`torch_config`), and tests/workers/test_lean_trainer.py fails so that the upgrade is seen.
"""

from __future__ import annotations

import ast
import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray.train.backend import Backend, BackendConfig

log = logging.getLogger("shunter.driver")

# What this module calls of `ray.train.torch.config`, on the workers.
RAY_TORCH_NAMES = ("_set_torch_distributed_env_vars", "_shutdown_torch", "TorchConfigContextManager")


def _ray_torch(name: str, /, **kwargs: Any) -> Any:
    """Call Ray's `ray.train.torch.config.<name>` (on a worker: it imports torch)."""
    from ray.train.torch import config

    return getattr(config, name)(**kwargs)


class _TorchContext:
    """Ray's `TorchConfigContextManager` around the train loop (it sets the rank's CUDA device), made on the worker."""

    def __enter__(self) -> Any:
        self._inner = _ray_torch("TorchConfigContextManager")
        return self._inner.__enter__()

    def __exit__(self, *exc: object) -> Any:
        return self._inner.__exit__(*exc)


class LeanTorchBackend(Backend):
    share_cuda_visible_devices: bool = True  # as Ray's: the ranks of one node see each other's GPUs (NCCL)

    def on_start(self, worker_group: Any, backend_config: LeanTorchConfig) -> None:  # type: ignore[override]  # Ray passes each backend its own config
        import ray
        from ray.train._internal.utils import update_env_vars

        gpus = worker_group.get_resources_per_worker().get("GPU", 0)
        backend = backend_config.backend or ("nccl" if gpus > 0 else "gloo")
        timeout_s = backend_config.timeout_s
        addr, port = worker_group.execute_single(0, _listen, timeout_s=timeout_s)
        # What torchrun sets, for code that reads them; nothing binds this port again.
        worker_group.execute(update_env_vars, {"MASTER_ADDR": addr, "MASTER_PORT": port})
        worker_group.execute(_ray_torch, "_set_torch_distributed_env_vars")  # LOCAL_RANK and the rest
        size = len(worker_group)
        ray.get([
            worker_group.execute_single_async(i, _join, backend=backend, world_rank=i, world_size=size, addr=addr,
                                              port=port, timeout_s=timeout_s)
            for i in range(size)
        ])  # fmt: skip

    def on_shutdown(self, worker_group: Any, backend_config: LeanTorchConfig) -> None:  # type: ignore[override]  # as on_start
        import ray
        from ray._private import ray_constants
        from ray.exceptions import GetTimeoutError
        from ray.train.constants import (
            DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
            TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
        )

        futures = worker_group.execute_async(_ray_torch, "_shutdown_torch", destroy_process_group=len(worker_group) > 1)
        timeout = ray_constants.env_integer(TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
                                            DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S)  # fmt: skip
        try:
            ray.get(futures, timeout=timeout)
        except GetTimeoutError:
            log.warning("torch process group shutdown timed out after %s seconds", timeout)
        worker_group.execute_single(0, _forget_store)


# Rank 0's rendezvous store, listening from the moment its port was chosen, for the life of the process group.
_store: Any = None


def _listen(*, timeout_s: int) -> tuple[str, int]:
    """On rank 0: the process group's rendezvous store, on a port the kernel gives it as it binds; (address, port).

    Ray's own set-up probes for a free port, lets it go, and has torch bind it later: in between, any process may
    take it (an outgoing connection's ephemeral port did, in a slow-tier run: `EADDRINUSE`, and the attempt failed).
    A store bound to port 0 holds its port from the start."""
    from datetime import timedelta

    import ray
    import torch.distributed as dist

    global _store
    addr = ray.util.get_node_ip_address()
    _store = dist.TCPStore(addr, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    return addr, int(_store.port)


def _join(*, backend: str, world_rank: int, world_size: int, addr: str, port: int, timeout_s: int) -> None:
    """Every rank: the process group over rank 0's store (Ray's `_setup_torch_process_group`, but for the store)."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    if backend == "nccl" and "TORCH_NCCL_BLOCKING_WAIT" not in os.environ:
        # As Ray sets it: a collective that times out fails, instead of hanging (no blocking wait: it costs speed).
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    timeout = timedelta(seconds=timeout_s)
    store = _store if world_rank == 0 else dist.TCPStore(addr, port, is_master=False, timeout=timeout)
    dist.init_process_group(backend=backend, store=store, rank=world_rank, world_size=world_size, timeout=timeout)


def _forget_store() -> None:
    global _store
    _store = None


@dataclass
class LeanTorchConfig(BackendConfig):
    """Ray's `TorchConfig` (same fields, same meaning), less its import of torch."""

    backend: str | None = None
    init_method: str = "env"  # the only one: LeanTorchBackend rendezvous through MASTER_ADDR/MASTER_PORT
    timeout_s: int = 1800

    @property
    def backend_cls(self) -> type:
        return LeanTorchBackend

    @property
    def train_func_context(self) -> type:
        return _TorchContext

    @property
    def framework(self) -> Any:
        from ray.train.v2._internal.util import TrainingFramework

        return TrainingFramework.TORCH

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "init_method": self.init_method, "timeout_s": self.timeout_s}


def torch_config(backend: str | None = None) -> BackendConfig:
    """The attempt's process-group configuration: `LeanTorchConfig`, or Ray's own `TorchConfig` where this Ray lacks
    what it calls. No backend: Ray Train's choice (NCCL with GPUs, else gloo)."""
    missing = [name for name in RAY_TORCH_NAMES if name not in ray_torch_names()]
    if missing:
        from ray.train.torch import TorchConfig  # imports torch

        log.warning("Ray Train's torch set-up moved (%s): the controller imports torch", ", ".join(missing))
        return TorchConfig(backend=backend)
    return LeanTorchConfig(backend=backend)


@functools.cache
def ray_torch_names() -> frozenset[str]:
    """The top-level names `ray.train.torch.config` defines, read from its source: importing it imports torch."""
    import ray.train  # (`find_spec` of the module itself would import its package, and torch with it)

    source = Path(ray.train.__file__).parent / "torch" / "config.py"
    try:
        tree = ast.parse(source.read_text())
    except (OSError, SyntaxError):
        return frozenset()
    return frozenset(node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.ClassDef))
