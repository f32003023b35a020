"""Ray Train's `TorchTrainer` less three helper processes: two actors that a shunter attempt never uses, and one
whose work runs as a thread of the controller.

Every `fit()` of Ray Train 2.60 starts, besides its controller and workers, four helper actors, each a Python process
of its own (about 2 CPU-seconds to start on the 2-core machine, and ~100 MB while it lives). Two of them are of no
use to an attempt run by shunter:

- `DatasetManager` (`DatasetsCallback`) is started on every worker-group start, with or without Ray Datasets, and
  imports `ray.data` there. A shunter train loop reads its data itself: a trainer given no `datasets` drops it.
- `PlacementGroupCleaner` (`PlacementGroupCleanerCallback`) is a *detached* actor that removes the worker group's
  placement group if the controller dies without doing so. An attempt's driver is a Ray Job: the placement group
  belongs to that job, and Ray removes a job's placement groups when its driver exits, which it does when the
  controller dies (`fit()` raises). Being detached, the cleaner also outlives the run by up to 12 s while Ray stops its
  monitor thread, so every attempt's Ray Job ended that much later than its training. (Ray misses a group that a
  controller registers while the GCS is already destroying it, as when a run is stopped during a worker-group restart;
  the dispatcher removes those: `service.backends.ray_jobs.orphaned`.)

The `SynchronizationActor` (the workers' barriers and reports) stays. So does the watch for node drain notices, which
`workers.drain` acts on, but as a thread of the controller (`workers.drain_watcher`), not the `PreemptionWatcher`
actor that the controller starts for it. Ray's own callback list is kept otherwise as it is, in its order, and the
callbacks shunter adds come after it as before. If a Ray upgrade moves any of these classes, nothing is dropped or
moved and the trainer is Ray's own (`tests/workers/test_lean_trainer.py` fails so that the upgrade is noticed).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("shunter.driver")


def unused_callback_types(*, has_datasets: bool = False) -> tuple[type, ...]:
    """The callback classes a shunter attempt drops: the datasets one only when given no datasets (none at all when
    this Ray has moved them)."""
    try:
        from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
        from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
    except ImportError as exc:  # a Ray that moved them: keep every callback
        log.warning("Ray Train's helper callbacks moved (%s): running with all of them", exc)
        return ()
    return (PlacementGroupCleanerCallback,) if has_datasets else (DatasetsCallback, PlacementGroupCleanerCallback)


def lean(callbacks: list[Any], *, has_datasets: bool) -> list[Any]:
    """Ray Train's default callbacks less those whose actors an attempt does not use (datasets kept when given)."""
    unused = unused_callback_types(has_datasets=has_datasets)
    return [cb for cb in callbacks if not isinstance(cb, unused)]


def drain_watcher_callback() -> Any:
    """Ray Train's drain watcher run in the controller's process (`workers.drain_watcher`), or None: the user switched
    the watcher off, or this Ray moved what it stands on (then Ray's own watcher actor runs, as before)."""
    try:
        from workers.drain_watcher import watcher_callback
    except ImportError as exc:
        log.warning("Ray Train's drain watcher moved (%s): running it as Ray does, an actor of its own", exc)
        return None
    return watcher_callback()


def trainer_class() -> type:
    """Ray Train's `TorchTrainer` with `lean` applied to its default callbacks and its process group set up by
    `workers.torch_config` (imports Ray Train: worker side only).

    Where that set-up is usable, the class is Ray's `DataParallelTrainer` given a `LeanTorchConfig`, which is all that
    `TorchTrainer` adds to it besides choosing the backend, as here; importing `TorchTrainer` would import torch
    (`ray.train.v2.torch` imports `ray.train.torch` first), and neither the driver nor the controller needs it."""
    from workers.torch_config import LeanTorchConfig, torch_config

    default = torch_config()
    lean_config = isinstance(default, LeanTorchConfig)
    if lean_config:
        from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer as Base
    else:  # a Ray that moved what LeanTorchConfig calls: Ray's own TorchTrainer and TorchConfig
        from ray.train.torch import TorchTrainer as Base  # type: ignore[assignment]  # the other of the two bases

    class LeanTorchTrainer(Base):
        def __init__(self, *args: Any, torch_config: Any = None, scaling_config: Any = None, **kwargs: Any) -> None:
            config: Any = torch_config or type(default)()  # LeanTorchConfig or Ray's TorchConfig
            if not lean_config:
                super().__init__(*args, torch_config=config, scaling_config=scaling_config, **kwargs)  # type: ignore[call-arg]  # TorchTrainer's
                return
            if not config.backend:  # as TorchTrainer chooses
                config.backend = "nccl" if scaling_config is not None and scaling_config.use_gpu else "gloo"
            super().__init__(*args, backend_config=config, scaling_config=scaling_config, **kwargs)

        def _create_default_callbacks(self) -> list[Any]:
            callbacks = lean(super()._create_default_callbacks(), has_datasets=bool(self.datasets))
            watcher = drain_watcher_callback()
            return callbacks if watcher is None else [*callbacks, watcher]

    return LeanTorchTrainer
