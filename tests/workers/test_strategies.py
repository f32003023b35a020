"""Each strategy on a real 2-worker Ray Train job (gloo): loss goes down, a checkpoint with manifest is written,
and a run resumed from it continues with equal parameters at the right step."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from workers.checkpoint import MANIFEST, verify

# Plain DDP (no accumulation) runs in the service end-to-end tests and the driver contract test; here DDP is
# exercised with accumulation and clipping on top, so the suite pays for one DDP fit pair, not two.
CASES = {
    "ddp-accum-clip": ({"kind": "ddp", "gradient_accumulation_steps": 2, "gradient_clipping": 1.0}, "mlp"),
    "fsdp": ({"kind": "fsdp", "fsdp": {"activation_checkpointing": True}}, "gpt2"),
    "zero1": ({"kind": "deepspeed", "deepspeed": {"zero_stage": 1}}, "mlp"),
    "zero2": ({"kind": "deepspeed", "deepspeed": {"zero_stage": 2}, "gradient_accumulation_steps": 2}, "mlp"),
    "zero3": ({"kind": "deepspeed", "deepspeed": {"zero_stage": 3}}, "gpt2"),
}
STEPS = 6


def fit(tmp_path: Path, name: str, config: dict[str, Any]) -> Any:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from tests.workers.loops import strategy_loop

    trainer = TorchTrainer(
        strategy_loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=str(tmp_path / "storage"), name=name),
        torch_config=TorchConfig(backend="gloo"),
    )
    return trainer.fit()


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_strategy_trains_checkpoints_and_resumes(
    case: str, ray_connected: object, deepspeed_ops: object, tmp_path: Path
) -> None:
    strategy, model = CASES[case]
    config = {"strategy": strategy, "model": model, "out": str(tmp_path), "steps": STEPS, "tag": "first"}
    started = time.monotonic()
    result = fit(tmp_path, f"{case}-first", config)
    took = time.monotonic() - started
    records = json.loads((tmp_path / "first-records.json").read_text())
    gaps = sorted(b["time"] - a["time"] for a, b in zip(records, records[1:], strict=False))
    print(f"{case}: fit of {STEPS} steps {took:.1f}s, median step {gaps[len(gaps) // 2]:.3f}s (incl. report)")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    losses = [r["loss"] for r in records]
    assert sum(losses[-2:]) < sum(losses[:2]), losses

    assert result.checkpoint is not None
    with result.checkpoint.as_directory() as local:
        manifest = verify(local)
        assert manifest["step"] == STEPS
        assert (Path(local) / MANIFEST).is_file()
        assert any(name.startswith("rng-rank1") for name in manifest["files"])  # rank 1's files are covered too

    # A new run (fresh name) started from that checkpoint, as shunter's `checkpoint.resume_from` does.
    resumed = {**config, "steps": STEPS + 2, "tag": "second", "resume_from": result.checkpoint.path}
    fit(tmp_path, f"{case}-second", resumed)
    before = torch.load(tmp_path / "first-final.pt")
    after = torch.load(tmp_path / "second-restored.pt")
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key
    steps = [r["step"] for r in json.loads((tmp_path / "second-records.json").read_text())]
    assert steps == [STEPS + 1, STEPS + 2]
