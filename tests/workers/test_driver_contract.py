"""What the driver relies on: the job spec, which each train worker reads from the API with its attempt token, picks
the strategy, and a worker group that dies mid-run restarts from its latest checkpoint and continues (not restarts)
training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sqlmodel import Session, col, select

from service.spec.job import JobSpec
from service.store.db import make_engine
from service.store.migrate import upgrade
from service.store.models import Attempt, Checkpoint, EndReason, Job, JobState, utcnow
from tests.live_api import add_attempt, live_api
from workers.checkpoint import verify
from workers.train_loop import train_loop_for


@pytest.mark.slow
def test_callable_takes_its_strategy_from_the_job_spec(ray_connected: object, tmp_path: Path) -> None:
    from ray.train import RunConfig, ScalingConfig

    from workers.lean_trainer import trainer_class

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
        result = trainer_class()(
            loop,
            train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(
                storage_path=str(tmp_path),
                name="from-spec",
                worker_runtime_env={"env_vars": api.job_env(job.id)},  # no spec: the workers ask the API for it
            ),
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

    from tests.workers.loops import strategy_loop
    from workers.lean_trainer import trainer_class

    config = {
        "strategy": {"kind": "ddp"},
        "out": str(tmp_path),
        "steps": 6,
        "tag": "run",
        "checkpoint_every": 2,
        "crash_at": 5,
    }
    trainer_class()(
        strategy_loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=str(tmp_path), name="crash", failure_config=FailureConfig(max_failures=1)),
    ).fit()
    assert (tmp_path / "crashed").exists()
    steps = [r["step"] for r in json.loads((tmp_path / "run-records.json").read_text())]
    # The restarted group resumed after a registered checkpoint (step 4, or step 2 when Ray had not yet registered
    # step 4 as the worker died), not from scratch.
    assert steps[0] in (3, 5) and steps == list(range(steps[0], 7)), steps


@pytest.mark.slow
def test_an_attempt_succeeds_when_its_loops_return_before_ray_trains_teardown(
    ray_connected: object, tmp_path: Path
) -> None:
    """The attempt's success is recorded by the Train callback once every rank's loop returned, after its last
    checkpoint is listed, and before `fit()` returns: no driver word here (the trainer is run without
    `workers.driver.run`), so only that end can have recorded it, and Ray Train's teardown is off the job's clock."""
    from workers.context import FINISHED_METRIC
    from workers.driver import build_trainer

    spec = JobSpec.model_validate(
        {
            "entrypoint": {"callable": "examples.mlp:train_loop"},
            "config": {"total_steps": 4, "checkpoint_every": 2, "report_every": 1},
            "resources": {"num_workers": 2, "resources_per_worker": {"CPU": 1}},
        }
    )
    engine = make_engine(f"sqlite:///{tmp_path / 'shunter.db'}")
    upgrade(engine)
    job = Job(name="ends-on-its-word", spec=spec.model_dump(mode="json"), state=JobState.RUNNING, attempt=1)
    add_attempt(engine, job)
    with live_api(engine, tmp_path) as api:
        trainer = build_trainer(spec, job_id=job.id, attempt=1, storage=str(tmp_path / "storage"),
                                api=api.attempt_api(job.id))  # fmt: skip
        result = trainer.fit()
        returned = utcnow()
    with Session(engine) as session:
        attempt = session.exec(select(Attempt).where(Attempt.job_id == job.id)).one()
        newest_first = select(Checkpoint).where(Checkpoint.job_id == job.id).order_by(col(Checkpoint.id).desc())
        latest = session.exec(newest_first).first()
        job_now = session.get(Job, job.id)
    engine.dispose()
    assert result.metrics["step"] == 4
    assert attempt.end_reason is EndReason.SUCCEEDED and attempt.driver_ended_at is not None
    assert attempt.driver_ended_at <= returned  # said by the callback, inside fit()
    assert latest is not None and latest.step == 4 and latest.created_at <= attempt.driver_ended_at
    assert job_now is not None and job_now.step == 4 and FINISHED_METRIC not in (job_now.latest_metrics or {})
