"""What a job's `entrypoint` runs: the train loop the driver hands to its TorchTrainer.

It sits above the strategies, the recipes and script mode, which it chooses between; none of them imports it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from service.spec import JobSpec


def train_loop_for(spec: JobSpec) -> tuple[Callable[[dict[str, Any]], None], dict[str, Any]]:
    """(train_loop_per_worker, train_loop_config) for the job's entrypoint, for the driver's TorchTrainer."""
    entry = spec.entrypoint
    if entry.callable:
        module_name, _, attr = entry.callable.partition(":")
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
        if not callable(target):
            raise TypeError(f"entrypoint.callable: {entry.callable} is not callable")
        return target, dict(spec.config)
    if entry.script:
        from workers.script import run_script

        return run_script, {"script": entry.script, "args": list(entry.args)}
    from workers.recipes import recipe_loop

    return recipe_loop(entry.recipe or ""), dict(spec.config)
