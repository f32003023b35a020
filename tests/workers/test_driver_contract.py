"""What the driver relies on: the job spec, which each train worker reads from the API with its attempt token, picks
the strategy, and a worker group that dies mid-run restarts from its latest checkpoint and continues (not restarts)
training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.db import make_engine
from service.migrate import upgrade
from service.models import Job, JobState
from service.spec import JobSpec
from tests.live_api import add_attempt, live_api
from workers.checkpoint import verify
from workers.entrypoint import train_loop_for


@pytest.mark.slow
def test_callable_takes_its_strategy_from_the_job_spec(ray_connected: object, tmp_path: Path) -> None:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    spec = JobSpec.model_validate(
        {
            "entrypoint": {"callable": "examples.gpt2_tiny:train_loop"},
            "config": {"steps": 4, "batch_size": 4},
            "strategy": {"kind": "fsdp", "fsdp": {"sharding": "shard_grad_op"}, "gradient_accumulation_steps": 2},
            "resources": {"num_workers": 2},
        }
    )
    loop, config = train_loop_for(spec)
    engine = make_engine(f"sqlite:///{tmp_path / 'shunter.db'}")
    upgrade(engine)
    job = Job(name="from-spec", spec=spec.model_dump(mode="json"), state=JobState.RUNNING, attempt=1)
    add_attempt(engine, job)
    with live_api(engine, tmp_path) as api:
        result = TorchTrainer(
            loop,
            train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(
                storage_path=str(tmp_path),
                name="from-spec",
                worker_runtime_env={"env_vars": api.job_env(job.id)},  # no spec: the workers ask the API for it
            ),
            torch_config=TorchConfig(backend="gloo"),
        ).fit()
    engine.dispose()
    assert result.metrics["step"] == 4
    with result.checkpoint.as_directory() as local:
        state = json.loads((Path(local) / "shunter-state.json").read_text())
        assert verify(local)["step"] == 4
    assert state["strategy"] == "fsdp"
    assert state["batch_in_epoch"] == 8  # 4 steps x 2 accumulated micro-batches


@pytest.mark.slow
def test_restarted_worker_group_continues_from_last_checkpoint(ray_connected: object, tmp_path: Path) -> None:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from tests.workers.loops import strategy_loop

    config = {
        "strategy": {"kind": "ddp"},
        "out": str(tmp_path),
        "steps": 6,
        "tag": "run",
        "checkpoint_every": 2,
        "crash_at": 5,
    }
    TorchTrainer(
        strategy_loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=str(tmp_path), name="crash", failure_config=FailureConfig(max_failures=1)),
        torch_config=TorchConfig(backend="gloo"),
    ).fit()
    assert (tmp_path / "crashed").exists()
    steps = [r["step"] for r in json.loads((tmp_path / "run-records.json").read_text())]
    # The restarted group resumed after a registered checkpoint (step 4, or step 2 when Ray had not yet registered
    # step 4 as the worker died), not from scratch.
    assert steps[0] in (3, 5) and steps == list(range(steps[0], 7)), steps
