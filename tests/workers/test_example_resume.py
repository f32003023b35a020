"""The example loop (examples/mlp.py, what users copy) resumed from the checkpoint of its last step: an attempt lost
right after that checkpoint was saved is retried from it and has nothing left to train. The long chaos run
(bench/chaos.py) saw three such retries fail as user errors (`loss` was unbound) before this was fixed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _fit(storage: Path, config: dict[str, object]) -> object:
    from ray.train import RunConfig, ScalingConfig

    from examples.mlp import train_loop
    from workers.lean_trainer import trainer_class

    trainer = trainer_class()(
        train_loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=1, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name="mlp-final-step", storage_path=str(storage)),
    )
    return trainer.fit()


def test_resumed_from_the_final_step_checkpoint_it_ends_as_a_success(ray_connected: object, tmp_path: Path) -> None:
    config = {"total_steps": 4, "checkpoint_every": 2, "trace_path": str(tmp_path / "trace.txt")}
    first = _fit(tmp_path / "storage", config)
    assert first.error is None and first.checkpoint is not None  # type: ignore[attr-defined]
    # The same run name on the same storage: Ray Train restores the run and get_checkpoint() is step 4's.
    second = _fit(tmp_path / "storage", config)
    assert second.error is None, second.error  # type: ignore[attr-defined]
    steps = [int(line.split()[1]) for line in (tmp_path / "trace.txt").read_text().splitlines()]
    assert steps == [1, 2, 3, 4], steps  # the second run trained nothing
