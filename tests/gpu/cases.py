"""The GPU tier's cases (tier A): shunter's strategy code under `torchrun`, with no Ray, through `workers.session`.

    python tests/gpu/cases.py --out bench/results/gpu.json            # every case, on the GPU when there is one
    python tests/gpu/cases.py --only ddp,fsdp2 --device cpu --nproc 2  # on CPU (gloo), as the CPU test runs it

Each case runs twice, each time as a fresh `torchrun` (a new attempt): `first` trains to step STEPS and checkpoints,
`resume` must start from that checkpoint at step STEPS, train to 2 x STEPS, and end with a lower loss than the first
run began with. A case passes when both runs pass their checks; its step time is the resume run's median, its memory
the peak that torch allocated on the GPU. The worker side (`python tests/gpu/cases.py --worker CASE PHASE DIR`) is what
torchrun starts; with --block-ray it refuses to import Ray and the control plane's server packages, which proves the
tier needs none of them (the device machine has none).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.abc
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
REFERENCE_DS_CONFIG = Path(__file__).with_name("ds_config.json")  # the reference guide's, as written
STEPS = 12
CASE_TIMEOUT_S = int(os.environ.get("GPU_TIER_CASE_TIMEOUT_S", "240"))  # one torchrun
BLOCKED = ("ray", "fastapi", "uvicorn", "sqlmodel", "sqlalchemy", "psycopg")

# name -> (what it proves, needs a GPU, strategy); the strategy None means the case drives its own code.
CASES: dict[str, tuple[str, bool, dict[str, Any] | None]] = {
    "ddp": ("DDP (NCCL on a GPU, gloo on CPU), fp32", False, {"kind": "ddp"}),
    "ddp_bf16": ("DDP with bf16 autocast", True, {"kind": "ddp", "mixed_precision": "bf16"}),
    "ddp_fp16_overflow": (
        "DDP with fp16 and GradScaler: a forced overflow step is skipped, not applied",
        True,
        {"kind": "ddp", "mixed_precision": "fp16"},
    ),
    "fsdp2": ("FSDP2 full shard, fp32", False, {"kind": "fsdp"}),
    "fsdp2_bf16": ("FSDP2 with bf16 mixed precision", True, {"kind": "fsdp", "mixed_precision": "bf16"}),
    "fsdp2_offload": (
        "FSDP2 with CPU offload and bf16",
        True,
        {"kind": "fsdp", "mixed_precision": "bf16", "fsdp": {"cpu_offload": True}},
    ),
    "zero3_reference": (
        "DeepSpeed ZeRO-3 from the guide's ds_config.json (bf16, offload_optimizer cpu), causal-lm recipe",
        True,
        None,
    ),
    "zero3_reference_cpu": (
        "DeepSpeed ZeRO-3 from the guide's ds_config.json with bf16 'auto' (fp32 on CPU), causal-lm recipe",
        False,
        None,
    ),
    "hf_trainer_zero3": (
        "an unchanged HF Trainer script with --deepspeed ds_config.json (the guide's) and --bf16",
        True,
        None,
    ),
    "hf_trainer_zero3_cpu": (
        "the same HF Trainer script on CPU: --use_cpu, the guide's config with bf16 'auto'",
        False,
        None,
    ),
}
GPU_ONLY_CPU_TWIN = {"zero3_reference": "zero3_reference_cpu", "hf_trainer_zero3": "hf_trainer_zero3_cpu"}


# ---- the worker side: what torchrun runs ------------------------------------------------------------------------


class _Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"the GPU tier must not import {name} (blocked by --block-ray)")


def tiny_gpt2() -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(vocab_size=64, n_positions=32, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    )


def sequences(count: int = 512, length: int = 32, vocab: int = 64) -> Any:
    """Arithmetic sequences modulo the vocabulary: learnable in a few dozen steps, so a falling loss means something."""
    import torch
    from torch.utils.data import TensorDataset

    generator = torch.Generator().manual_seed(0)
    start = torch.randint(0, vocab, (count, 1), generator=generator)
    stride = torch.randint(1, 4, (count, 1), generator=generator)
    return TensorDataset((start + stride * torch.arange(length)) % vocab)


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_strategy_case(name: str, phase: str, run_dir: Path, strategy_dict: dict[str, Any]) -> dict[str, Any]:
    import torch
    from torch.utils.data import DataLoader

    from service.spec.strategy import StrategySpec
    from workers import session
    from workers.strategies import prepare

    here = session.start_local(run_dir)
    strategy = StrategySpec.model_validate({"seed": 0, **strategy_dict})
    loader = DataLoader(sequences(), batch_size=8, shuffle=True, drop_last=True)
    prepared = prepare(tiny_gpt2(), lambda params: torch.optim.AdamW(params, lr=3e-3), loader, strategy=strategy)
    began = prepared.step
    target = STEPS if phase == "first" else 2 * STEPS
    checks: dict[str, Any] = {"began_at_step": began}
    if phase == "resume" and began != STEPS:
        raise AssertionError(f"resumed at step {began}, not at the first run's checkpoint (step {STEPS})")
    losses: list[float] = []
    times: list[float] = []
    overflow_at = STEPS + 3 if name == "ddp_fp16_overflow" and phase == "resume" else None
    for _ in prepared.epochs(10_000):
        for (ids,) in prepared.batches():
            _sync(here)
            started = time.perf_counter()
            with prepared.autocast():
                output = prepared.model(input_ids=ids, labels=ids)
            loss, computed_in = output.loss, output.logits.dtype
            if overflow_at is not None and prepared.step + 1 == overflow_at:
                checks.update(_overflow_step(prepared, loss))
            else:
                prepared.backward(loss)
            _sync(here)
            times.append(time.perf_counter() - started)
            losses.append(float(loss.detach().float()))
            done = prepared.step >= target
            prepared.report(loss=losses[-1], checkpoint=done)
            if done:
                break
        if prepared.step >= target:
            break
    checks["compute_dtype"] = str(computed_in)
    wanted = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(strategy_dict.get("mixed_precision", "no"))
    if here.type == "cuda" and computed_in != (wanted or torch.float32):
        raise AssertionError(f"the model computed in {computed_in}, not in {wanted or torch.float32}")
    return {"losses": losses, "times": times, "checks": checks, "steps": prepared.step}


def _overflow_step(prepared: Any, loss: Any) -> dict[str, Any]:
    """An inf loss under fp16: GradScaler must find inf gradients, skip the optimizer step and halve its scale."""
    import torch

    if prepared.scaler is None:
        raise AssertionError("fp16 without a GradScaler")
    before = [p.detach().clone() for p in prepared.module.parameters()]
    scale = float(prepared.scaler.get_scale())
    skipped = prepared.skipped_steps
    prepared.backward(loss * float("inf"))
    unchanged = all(torch.equal(a, b) for a, b in zip(before, prepared.module.parameters(), strict=True))
    after = float(prepared.scaler.get_scale())
    if not unchanged:
        raise AssertionError("an overflowing fp16 step changed the weights")
    if not after < scale:
        raise AssertionError(f"GradScaler's scale did not fall on an overflow ({scale} -> {after})")
    if prepared.skipped_steps != skipped + 1:
        raise AssertionError("the skipped step was not counted in Prepared.skipped_steps")
    return {"overflow_weights_unchanged": True, "overflow_scale": [scale, after]}


def write_texts(path: Path) -> None:
    sentence = "the quick brown fox jumps over the lazy dog while shunter queues the next training job. "
    path.write_text("".join(json.dumps({"text": sentence * 4}) + "\n" for _ in range(64)))


def run_recipe_case(name: str, phase: str, run_dir: Path) -> dict[str, Any]:
    from workers import session
    from workers.recipes.causal_lm import train_loop

    session.start_local(run_dir)
    config = json.loads(REFERENCE_DS_CONFIG.read_text())
    if name == "zero3_reference_cpu":
        config["bf16"]["enabled"] = "auto"  # bf16 "auto" resolves to fp32 on CPU
    data = run_dir / "texts.jsonl"
    if not data.exists():
        write_texts(data)
    began = session.get_checkpoint()
    train_loop({
        "model_config": {"model_type": "gpt2", "vocab_size": 256, "n_positions": 32, "n_embd": 64, "n_layer": 2,
                         "n_head": 4},
        "dataset_path": str(data), "seq_len": 32, "batch_size": 2, "lr": 3e-3,
        "max_steps": STEPS if phase == "first" else 2 * STEPS, "log_every": 1,
        "strategy": {"kind": "deepspeed", "seed": 0, "deepspeed": {"config": config}},
    })  # fmt: skip
    if int(os.environ.get("RANK", "0")) != 0:  # rank 0 writes the reports and the model: it checks them
        return {"losses": [], "times": [], "checks": {}, "steps": None}
    mine = session.reported(run_dir)[-STEPS:]  # one report a step (log_every 1): this run's are the last STEPS
    steps = [int(r["step"]) for r in mine]
    if phase == "resume" and (began is None or steps[0] != STEPS + 1):
        raise AssertionError(f"the resumed recipe reported steps {steps[:3]}..., not from {STEPS + 1}")
    times = [b["reported_at"] - a["reported_at"] for a, b in zip(mine, mine[1:], strict=False)]
    losses = [float(r["loss"]) for r in mine if r.get("loss") is not None]
    if not (run_dir / "model" / "config.json").is_file():
        raise AssertionError("the recipe saved no final model")
    # The saved model loads as a Hugging Face model and has learned: ZeRO-3 gathers its sharded weights to save them.
    import torch
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(run_dir / "model", local_files_only=True)
    ids = torch.tensor([list(b"the quick brown fox")])
    with torch.no_grad():
        loaded_loss = float(saved(input_ids=ids, labels=ids).loss)
    if not loaded_loss < 5.0:  # untrained: ln(256) = 5.5
        raise AssertionError(
            f"the saved model's loss is {loaded_loss:.3f}: it did not learn, or was saved unsharded wrong"
        )
    checks = {"steps": steps[:2] + steps[-1:], "loaded_loss": loaded_loss}
    return {"losses": losses, "times": times, "checks": checks, "steps": steps[-1]}


def worker(names: list[str], phase: str, run_dir: Path, block_ray: bool) -> int:
    """Run each case's `phase` in turn in this rank's process (one case: as the tier runs them; several: `--together`,
    sharing the process group, the imports and the torchrun start), each in `run_dir/<case>`; rank 0 writes each
    case's result there. A case that fails does not stop the next one."""
    if block_ray:
        sys.meta_path.insert(0, _Refuse())
    sys.path.insert(0, str(ROOT))
    rank = int(os.environ.get("RANK", "0"))
    passed = True
    for name in names:
        result: dict[str, Any] = {"name": name, "phase": phase, "passed": False}
        case_dir = run_dir / name
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            strategy = CASES[name][2]
            if strategy is not None:
                outcome = run_strategy_case(name, phase, case_dir, strategy)
            else:
                outcome = run_recipe_case(name, phase, case_dir)
            result.update(outcome)
            result["passed"] = True
            if torch.cuda.is_available():
                result["peak_gpu_mem_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        except BaseException as error:  # noqa: BLE001 - every failure becomes the case's result
            result["error"] = "".join(traceback.format_exception(error))[-4000:]
            print(f"[gpu tier] rank {rank}, {name}: {result['error']}", file=sys.stderr, flush=True)
        passed = passed and result["passed"]
        if rank == 0:
            case_dir.mkdir(parents=True, exist_ok=True)
            (case_dir / f"result-{phase}.json").write_text(json.dumps(result, default=str))
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001, S110 - the results are written; a teardown error changes nothing
        pass
    return 0 if passed else 1


# ---- the HF Trainer case: the example script exactly as a user runs it -------------------------------------------


def hf_trainer_case(run_dir: Path, nproc: int, env: dict[str, str], *, cpu: bool = False) -> dict[str, Any]:
    """examples/scripts/hf_trainer.py under torchrun with the guide's ds_config.json and --bf16, then again with
    --resume_from_checkpoint: the second run must continue from the first one's step and reach twice it."""
    out = run_dir / "out"
    script = ROOT / "examples" / "scripts" / "hf_trainer.py"
    config = REFERENCE_DS_CONFIG
    if cpu:
        config = run_dir / "ds_config.json"
        config.write_text(REFERENCE_DS_CONFIG.read_text().replace('"enabled": true', '"enabled": "auto"'))
    precision = ["--use_cpu"] if cpu else ["--bf16"]
    common = ["--output_dir", str(out), "--logging_steps", "1", "--report_to", "none", *precision,
              "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "4",
              "--deepspeed", str(config), "--learning_rate", "1e-3",
              "--train_file", str(ROOT / "examples/data/tiny.jsonl"),
              "--save_steps", str(STEPS)]  # fmt: skip
    result: dict[str, Any] = {"passed": False}
    runs = [["--max_steps", str(STEPS)], ["--max_steps", str(2 * STEPS), "--resume_from_checkpoint",
                                          str(out / f"checkpoint-{STEPS}")]]  # fmt: skip
    saved = out / f"checkpoint-{STEPS}" / "trainer_state.json"
    for phase, extra in zip(("first", "resume"), runs, strict=True):
        log = run_dir / f"{phase}.log"
        code = _torchrun(["python", str(script), *common, *extra], nproc, env, log)
        if code != 0:
            result["error"] = f"{phase}: exit {code}\n" + log.read_text()[-4000:]
            return result
        if phase == "first":
            first_state = saved.read_bytes(), saved.stat().st_mtime_ns
    state = json.loads((out / f"checkpoint-{2 * STEPS}" / "trainer_state.json").read_text())
    losses = [float(h["loss"]) for h in state["log_history"] if "loss" in h]
    runtime = [float(n) for n in re.findall(r"'train_runtime': '?([0-9.]+)", (run_dir / "resume.log").read_text())]
    start, end = _mean(losses[:3]), _mean(losses[-3:])
    result.update(steps=int(state["global_step"]), loss_first=start, loss_last=end,
                  checks={"global_step": state["global_step"], "logged_losses": len(losses)},
                  times=[runtime[-1] / STEPS] if runtime else [])  # fmt: skip
    rewritten = (saved.read_bytes(), saved.stat().st_mtime_ns) != first_state
    if int(state["global_step"]) != 2 * STEPS:
        result["error"] = f"the resumed run ended at step {state['global_step']}, not {2 * STEPS}"
    elif resumed_at(run_dir / "resume.log") != STEPS + 1 or rewritten:
        # Trainer says "Continuing training from checkpoint" at INFO only; its progress bar starts at the step it
        # resumed at, and a run from scratch would have written checkpoint-STEPS again.
        result["error"] = "the second run did not resume from the first one's checkpoint"
    elif start is None or end is None or not end < start:
        result["error"] = f"the loss did not fall: {start} at the first steps, {end} at the last"
    else:
        result["passed"] = True
    return result


def resumed_at(log: Path) -> int | None:
    """The first step Trainer's progress bar shows after 0 in a run's log: the step a resumed run begins with."""
    shown = [int(n) for n in re.findall(rf"\b(\d+)/{2 * STEPS}\b", log.read_text()) if int(n) > 0]
    return shown[0] if shown else None


# ---- the driver side: every case, two torchruns each, one JSON --------------------------------------------------


def _torchrun(command: list[str], nproc: int, env: dict[str, str], log: Path, timeout: float = CASE_TIMEOUT_S) -> int:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    args = command[1:] if command[0] == "python" else command
    with log.open("w") as out:
        try:
            return subprocess.run([*launcher, *args], env=env, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=timeout, cwd=ROOT, check=False).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            out.write(f"\n[gpu tier] timed out after {timeout:.0f} s\n")
            return 124


def run_case(name: str, nproc: int, device: str, block_ray: bool, keep: Path | None) -> dict[str, Any]:
    """One case, in torchruns of its own."""
    return run_cases([name], nproc, device, block_ray, keep)[0]


def run_cases(names: list[str], nproc: int, device: str, block_ray: bool, keep: Path | None) -> list[dict[str, Any]]:
    """Cases that share their torchruns: one per phase, each rank running the cases in turn (`worker`). Each case still
    resumes in a fresh process, its own checkpoint, at its own step. The HF Trainer cases run their script: one
    each."""
    results: dict[str, dict[str, Any]] = {}
    together = []
    for name in names:
        if CASES[name][1] and device != "cuda":
            results[name] = {"name": name, "what": CASES[name][0], "passed": False, "skipped": "needs a GPU"}
        elif name.startswith("hf_trainer"):
            results[name] = _run_hf_case(name, nproc, device, keep)
        else:
            together.append(name)
    if together:
        results.update(_run_shared(together, nproc, device, block_ray, keep))
    return [results[name] for name in names]


def _case_env(device: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(":"),
           "PYTHONUNBUFFERED": "1"}  # fmt: skip
    if device != "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _run_hf_case(name: str, nproc: int, device: str, keep: Path | None) -> dict[str, Any]:
    run_dir = Path(tempfile.mkdtemp(prefix=f"gpu-tier-{name}-"))
    started = time.monotonic()
    try:
        outcome = hf_trainer_case(run_dir, nproc, _case_env(device), cpu=name.endswith("_cpu"))
        return _result(name, outcome, time.monotonic() - started)
    finally:
        _keep(run_dir, keep, name)
        shutil.rmtree(run_dir, ignore_errors=True)


def _run_shared(names: list[str], nproc: int, device: str, block_ray: bool, keep: Path | None) -> dict[str, Any]:
    run_dir = Path(tempfile.mkdtemp(prefix="gpu-tier-"))
    env = _case_env(device)
    started = time.monotonic()
    outcomes: dict[str, dict[str, Any]] = {name: {} for name in names}
    first_losses: dict[str, list[float]] = {}
    try:
        for phase in ("first", "resume"):
            running = [n for n in names if phase == "first" or outcomes[n].get("passed")]
            if not running:
                break
            flags = [str(Path(__file__).resolve()), "--worker", ",".join(running), phase, str(run_dir)]
            log = run_dir / f"{phase}.log"
            code = _torchrun(["python", *flags, *(["--block-ray"] if block_ray else [])], nproc, env, log,
                             timeout=CASE_TIMEOUT_S * len(running))  # fmt: skip
            for name in running:
                written = run_dir / name / f"result-{phase}.json"
                outcome = json.loads(written.read_text()) if written.exists() else {"passed": False}
                if code != 0 and outcome.get("passed"):  # another rank failed: only rank 0 writes, so none passes
                    outcome.update(passed=False, error=f"exit {code}: a rank failed")
                if not outcome.get("passed"):
                    outcome.setdefault("error", f"exit {code}")
                    outcome["error"] = f"{phase}: {outcome['error']}\n{log.read_text()[-3000:]}"
                elif phase == "first":
                    first_losses[name] = outcome.get("losses") or []
                else:
                    start, end = _mean(first_losses[name][:3]), _mean((outcome.get("losses") or [])[-3:])
                    outcome["loss_first"], outcome["loss_last"] = start, end
                    if start is None or end is None or not end < start:
                        outcome["passed"] = False
                        outcome["error"] = f"the loss did not fall: {start} at the first steps, {end} at the last"
                outcomes[name] = outcome
        seconds = (time.monotonic() - started) / len(names)  # shared: each case's part of the whole
        return {name: _result(name, outcomes[name], seconds) for name in names}
    finally:
        for name in names:
            _keep(run_dir / name, keep, name)
        if keep is not None:
            for phase in ("first", "resume"):
                with contextlib.suppress(OSError):
                    shutil.copy(run_dir / f"{phase}.log", keep / f"{'-'.join(names)}-{phase}.log")
        shutil.rmtree(run_dir, ignore_errors=True)


def _result(name: str, outcome: dict[str, Any], seconds: float) -> dict[str, Any]:
    times = outcome.get("times") or []
    if outcome.get("loss_first") is None and outcome.get("losses"):
        outcome["loss_last"] = _mean(outcome["losses"][-3:])
    return {
        "name": name,
        "what": CASES[name][0],
        "passed": bool(outcome.get("passed")),
        "step_ms": round(statistics.median(times[2:] or times) * 1000, 2) if times else None,
        "peak_gpu_mem_mb": outcome.get("peak_gpu_mem_mb"),
        "loss_first": outcome.get("loss_first"),
        "loss_last": outcome.get("loss_last"),
        "checks": outcome.get("checks"),
        "seconds": round(seconds, 1),
        **({"error": outcome["error"]} if outcome.get("error") else {}),
    }


def _keep(run_dir: Path, keep: Path | None, name: str) -> None:
    if keep is not None and run_dir.exists():
        shutil.copytree(run_dir, keep / name, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.pt", "*.bin",
                        "*.safetensors", "global_step*", "checkpoint-*", "model"))  # fmt: skip


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def environment() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    info["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    for name in ("transformers", "deepspeed", "accelerate"):
        try:
            info[name] = __import__(name).__version__
        except Exception as error:  # noqa: BLE001 - the case that needs it fails with the reason
            info[name] = f"missing: {error}"
    return info


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", nargs=3, metavar=("CASES", "PHASE", "RUN_DIR"), help="comma-separated cases")
    parser.add_argument(
        "--together",
        action="store_true",
        help="the cases share their torchruns, one per phase "
        "(a torchrun's start is most of a case's time); default: each case its own two",
    )
    parser.add_argument("--block-ray", action="store_true", help="refuse to import Ray and the server packages")
    parser.add_argument("--only", help="comma-separated case names (default: all)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    parser.add_argument("--nproc", type=int, default=1, help="ranks per case (one GPU: 1; NCCL refuses two on one)")
    parser.add_argument("--out", type=Path, help="where to write the tier's JSON")
    parser.add_argument("--keep", type=Path, help="copy each case's logs and metrics here")
    parser.add_argument("--budget-s", type=float, default=None, help="start no case after this many seconds")
    args = parser.parse_args()
    if args.worker:
        cases, phase, run_dir = args.worker
        return worker(cases.split(","), phase, Path(run_dir), args.block_ray)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    names = [n.strip() for n in args.only.split(",")] if args.only else list(CASES)
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        parser.error(f"--only: unknown cases {unknown}; the cases are {sorted(CASES)}")
    if device == "cuda" and not args.only:
        names = [n for n in names if n not in GPU_ONLY_CPU_TWIN.values()]
    report = {**environment(), "nproc_per_node": args.nproc, "cases": []}
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    batches = [names] if args.together else [[name] for name in names]
    for batch in batches:
        if args.budget_s is not None and time.monotonic() - began > args.budget_s:
            spent = f"out of time: the run's budget of {args.budget_s:.0f} s was spent"
            report["cases"] += [{"name": n, "what": CASES[n][0], "passed": False, "skipped": spent} for n in batch]
            continue
        for case in run_cases(batch, args.nproc, device, args.block_ray, args.keep):
            report["cases"].append(case)
            mark = "skip" if case.get("skipped") else ("PASS" if case["passed"] else "FAIL")
            print(f"[gpu tier] {mark} {case['name']}: {case.get('step_ms')} ms/step, {case.get('peak_gpu_mem_mb')} "
                  f"MiB peak, loss {case.get('loss_first')} -> {case.get('loss_last')} ({case.get('seconds')} s)"
                  + (f"\n{case['error']}" if case.get("error") else ""), flush=True)  # fmt: skip
        if args.out:  # written after each case (or batch): a run cut short still says what it had
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2) + "\n")
    ran = [c for c in report["cases"] if not c.get("skipped")]
    return 0 if ran and all(c["passed"] for c in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
