"""The GPU tier (tests/gpu/README.md): on CPU its strategy cases run under torchrun with gloo and no Ray, which proves
the seam (`workers.session`) the tier stands on; the cases that need a GPU skip with their reason, and on a machine
with CUDA the whole tier runs. What a lent device ran is a record (bench/results/gpu.json, with its commit), read
by people and not by a test: a committed file proves nothing about the code beside it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu import cases

ROOT = Path(__file__).resolve().parents[2]


def _tier(tmp_path: Path, *args: str) -> tuple[int, dict]:
    out = tmp_path / "gpu.json"
    done = subprocess.run([sys.executable, str(ROOT / "tests/gpu/cases.py"), "--out", str(out), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=900, check=False)  # fmt: skip
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    return done.returncode, json.loads(out.read_text())


@pytest.mark.slow
def test_strategies_train_checkpoint_and_resume_under_torchrun_without_ray(tmp_path: Path) -> None:
    """DDP, FSDP2 and ZeRO-3 from the guide's config (the causal-lm recipe) at two ranks on gloo, with Ray and the
    server packages refused at import: each trains, checkpoints, resumes in a fresh torchrun at its step, and learns."""
    # --together: the three share one torchrun per phase (six torchruns of two ranks were 178 s of a slow-tier lane);
    # each still resumes in a fresh process from its own checkpoint.
    code, report = _tier(tmp_path, "--only", "ddp,fsdp2,zero3_reference_cpu", "--device", "cpu", "--nproc", "2",
                         "--block-ray", "--together")  # fmt: skip
    by_name = {c["name"]: c for c in report["cases"]}
    for name, case in by_name.items():
        assert case["passed"], f"{name}: {case.get('error')}"
        assert case["loss_last"] < case["loss_first"], name
    assert code == 0
    assert by_name["ddp"]["checks"]["began_at_step"] == cases.STEPS
    assert by_name["fsdp2"]["checks"]["began_at_step"] == cases.STEPS
    assert by_name["zero3_reference_cpu"]["checks"]["steps"] == [cases.STEPS + 1, cases.STEPS + 2, 2 * cases.STEPS]
    # The recipe's final model, gathered from ZeRO-3's shards, loads with transformers and has learned (it was
    # tests/workers/test_recipe.py's ZeRO-3 fit on Ray; the recipe on Ray is that module's FSDP fit and the service's).
    assert by_name["zero3_reference_cpu"]["checks"]["loaded_loss"] < 5.0
    # Same seed, same data, same sampler: FSDP2 at two ranks learns exactly what DDP does.
    assert by_name["fsdp2"]["loss_last"] == pytest.approx(by_name["ddp"]["loss_last"], rel=1e-4)


def test_a_case_that_needs_a_gpu_skips_on_cpu_with_its_reason(tmp_path: Path) -> None:
    for name, (_, needs_gpu, _) in cases.CASES.items():
        if needs_gpu:
            case = cases.run_case(name, 1, "cpu", block_ray=True, keep=None)
            assert case == {"name": name, "what": cases.CASES[name][0], "passed": False, "skipped": "needs a GPU"}


@pytest.mark.slow
@pytest.mark.skipif(
    not __import__("torch").cuda.is_available(),
    reason="needs a CUDA GPU: on a lent device, `bash tests/gpu/run.sh` runs the tier (bench/results/gpu.json)",
)
def test_the_whole_gpu_tier(tmp_path: Path) -> None:
    code, report = _tier(tmp_path, "--block-ray")
    failed = [c for c in report["cases"] if not c["passed"]]
    assert code == 0 and not failed, failed
