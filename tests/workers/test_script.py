"""Script mode: an unchanged torchrun DDP script runs in every worker with torchrun's environment."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.spec import JobSpec
from workers.entrypoint import train_loop_for


def fit_script(tmp_path: Path, script: str, args: list[str], name: str) -> object:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    spec = JobSpec.model_validate({"entrypoint": {"script": script, "args": args}})
    loop, config = train_loop_for(spec)
    trainer = TorchTrainer(
        loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=str(tmp_path / "storage"), name=name),
        torch_config=TorchConfig(backend="gloo"),
    )
    return trainer.fit()


@pytest.mark.slow  # real Ray Train runs of a script (issue 34: they belong to the slow tier)
def test_unchanged_ddp_script_runs_with_torchrun_env(ray_connected: object, tmp_path: Path, repo_root: Path) -> None:
    script = str(repo_root / "examples" / "scripts" / "train_ddp.py")
    fit_script(tmp_path, script, ["--epochs", "2", "--env-out", str(tmp_path)], "script-ddp")
    envs = [json.loads((tmp_path / f"env-rank{rank}.json").read_text()) for rank in range(2)]
    assert [e["RANK"] for e in envs] == ["0", "1"]
    assert {e["WORLD_SIZE"] for e in envs} == {"2"}
    assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"2"}
    assert {e["GROUP_RANK"] for e in envs} == {"0"}
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
    assert {e["TORCHELASTIC_RUN_ID"] for e in envs} == {"script-ddp"}


@pytest.mark.slow
def test_failing_script_fails_the_run(ray_connected: object, tmp_path: Path) -> None:
    from ray.train import TrainingFailedError

    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    with pytest.raises(TrainingFailedError, match="exited with code 3"):
        fit_script(tmp_path, str(script), [], "script-fail")
