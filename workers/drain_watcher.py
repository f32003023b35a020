"""Ray Train's drain watcher as a thread of the attempt's controller, not a Python process of its own.

Ray Train 2.60's controller adds a `PreemptionCallback` to every run. On each worker-group start it creates a
`PreemptionWatcher` *actor*: one more Ray worker process per attempt (~1.4 CPU-seconds to start on the 2-core
machine, ~100 MB while the attempt lives) whose only work is a thread that asks the GCS every few seconds which nodes
are draining, and marks every worker of the group when one of theirs is. shunter's drain handling (`workers.drain`)
stands on those marks.

`InControllerPreemptionCallback` is Ray's callback with the same `PreemptionWatcher` constructed in the controller's
process instead: its thread polls there, with the same interval (`RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S`), and is
stopped on every path Ray's stops the actor (a new worker group, shutdown, abort). Ray's own callback is switched off
with Ray's own setting (`RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=0`, which the trainer passes on to the controller); a user
who set that setting off gets no watcher at all, as with Ray. `workers.lean_trainer` uses this module only where
it imports (`watcher_callback`); a Ray that moved these names runs its own callback.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from ray._private.ray_constants import env_bool
from ray.train.v2._internal.callbacks.preemption_callback import PreemptionCallback
from ray.train.v2._internal.constants import DEFAULT_ENABLE_PREEMPTION_WATCHER, ENABLE_PREEMPTION_WATCHER_ENV_VAR
from ray.train.v2._internal.execution.preemption import PreemptionWatcher

if TYPE_CHECKING:
    from ray.train.v2._internal.execution.worker_group import WorkerGroup

log = logging.getLogger("shunter.driver")
_switched_off_by_us = False  # this process set Ray's setting off to run the watcher in the controller instead


class InControllerPreemptionCallback(PreemptionCallback):
    """Ray's `PreemptionCallback`, its `PreemptionWatcher` a plain object (and thread) of the controller."""

    def after_worker_group_start(self, worker_group: WorkerGroup) -> None:
        self._stop_watcher()  # as Ray's: a start that failed after this hook left no shutdown hook to run
        node_to_ranks: dict[str, list[int]] = {}
        worker_actors_by_rank: dict[int, Any] = {}
        for worker in worker_group.get_workers():
            context = worker.distributed_context
            assert context is not None, "a started worker group's workers have their ranks"
            rank = context.world_rank
            node_to_ranks.setdefault(worker.metadata.node_id, []).append(rank)
            worker_actors_by_rank[rank] = worker.actor
        self._watcher = PreemptionWatcher(  # type: ignore[assignment]  # an object here, where Ray keeps an actor
            node_to_ranks=node_to_ranks, poll_interval_s=self._poll_interval_s,
            worker_actors_by_rank=worker_actors_by_rank)  # fmt: skip

    def _stop_watcher(self) -> None:
        watcher, self._watcher = self._watcher, None
        stop = getattr(watcher, "_stop_event", None)
        if stop is not None:
            stop.set()  # its daemon thread ends at once (it waits on this event); nothing else to release
        elif watcher is not None:  # a Ray that renamed it (tests/workers/test_lean_trainer.py fails): never fail a run
            log.warning("Ray's PreemptionWatcher has no _stop_event: its thread polls on until the controller ends")


def watcher_callback() -> InControllerPreemptionCallback | None:
    """The callback to add to a run, with Ray's own switched off for it; None when the user switched the watcher off."""
    global _switched_off_by_us
    if not _switched_off_by_us and not env_bool(ENABLE_PREEMPTION_WATCHER_ENV_VAR, DEFAULT_ENABLE_PREEMPTION_WATCHER):
        return None
    os.environ[ENABLE_PREEMPTION_WATCHER_ENV_VAR] = "0"  # propagated to the controller by Ray with the run
    _switched_off_by_us = True
    return InControllerPreemptionCallback()
