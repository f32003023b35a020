"""Each strategy on a real 2-worker Ray Train job (gloo) on a 3-node local cluster: loss goes down, a checkpoint with
manifest is written, and runs resumed from it at 3 workers (one per node) or at 1, or both (issue 16: resume at any
world size; `RESIZES`) continue with equal parameters at the right step, with loss still falling, and read the epoch
on from where the 2 workers left it.

The cases share three fits (issue 34: twelve fits of ~19 s each were ~4 minutes of a slow-tier lane, most of it
process starts and imports): the five first runs in one worker group, one after another, then the resumed runs of
each world size in one. Each case stays a run of its own, with its own checkpoint, resumed from by its own runs."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from service.backends.ray_local import LocalHead
from tests.workers.loops import full_loss, tiny_data
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
# Steps of each case's first run: a different number each, since the cases of one fit are one Ray Train run, where a
# checkpoint's folder is named by its step (`checkpoint-step00000006`): with one number, each case's would replace the
# one before it. None ends on an epoch's last batch (8 optimizer steps an epoch for the MLP at 2 workers, 4 with
# accumulation; 4 for GPT-2), so each resumed run reads on inside the epoch the first one left (`check_data_position`).
STEPS = {"ddp-accum-clip": 6, "fsdp": 7, "zero1": 5, "zero2": 9, "zero3": 10}
# The world sizes each case resumes at, wider (3 workers, one per node) and narrower (1). FSDP2 and ZeRO-3 shard the
# parameters themselves, so both ways are run; DDP loads rank 0's whole state at any size (one way is enough), and
# ZeRO 1 and 2 differ only in what they partition of the same optimizer state, which one universal-checkpoint path
# re-partitions (`workers.checkpoint._load_deepspeed_resized`): stage 1 is resumed narrower, stage 2 wider (issue
# 34: three fits fewer, each ~19 s, with every direction still run for each kind of state).
RESIZES = {
    "ddp-accum-clip": ((3, "wider"),),
    "fsdp": ((3, "wider"), (1, "narrower")),
    "zero1": ((1, "narrower"),),
    "zero2": ((3, "wider"),),
    "zero3": ((3, "wider"), (1, "narrower")),
}


def fit(storage: Path, name: str, cases: list[dict[str, Any]], workers: int) -> Any:
    from ray.train import RunConfig, ScalingConfig

    from tests.workers.loops import strategy_cases_loop
    from workers.lean_trainer import trainer_class

    trainer = trainer_class()(
        strategy_cases_loop,
        train_loop_config={"cases": cases},
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=str(storage), name=name),
    )
    return trainer.fit()


@pytest.fixture(scope="module")
def three_nodes(ray_head: LocalHead, session_multinode: object) -> Iterator[object]:
    """This process as the driver of the session's 3-node cluster (`ray.cluster_utils.Cluster`: a head and two nodes
    of 1 CPU each on their own addresses), so a run at 3 workers has one on each node; afterwards, of the session's
    head again."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    try:
        ray.init(address=session_multinode.cluster.address, log_to_driver=False)  # type: ignore[attr-defined]
        yield session_multinode
        ray.shutdown()
    finally:
        ray.init(address=ray_head.gcs_address, log_to_driver=False)


@dataclass
class Runs:
    """Every case's first run (2 workers) and its resumed runs, three fits in all: the first runs of all five cases
    in one, then each world size's resumed runs in one (`tests.workers.loops.strategy_cases_loop`). Each case is
    still a run of its own: its own checkpoint, resumed from by its own runs. Where a fit failed, `error` says why,
    and every case's test fails with it."""

    out: Path
    checkpoints: dict[str, Any] = field(default_factory=dict)  # case -> the Checkpoint its first run reported
    seconds: dict[str, float] = field(default_factory=dict)  # fit -> wall seconds
    error: str | None = None


def case_config(runs: Runs, case: str, tag: str, **extra: Any) -> dict[str, Any]:
    strategy, model = CASES[case]
    (runs.out / case).mkdir(parents=True, exist_ok=True)
    return {"strategy": strategy, "model": model, "out": str(runs.out / case), "tag": tag, "metrics": {"case": case},
            **extra}  # fmt: skip


@pytest.fixture(scope="module")
def runs(three_nodes: object, deepspeed_ops: object, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    runs = Runs(out=tmp_path_factory.mktemp("strategies"))
    storage = runs.out / "storage"
    try:
        started = time.monotonic()
        first = fit(
            storage, "first", [case_config(runs, case, "first", steps=STEPS[case]) for case in CASES], workers=2
        )
        runs.seconds["first"] = time.monotonic() - started
        for checkpoint, metrics in first.best_checkpoints:
            runs.checkpoints[metrics["case"]] = checkpoint
        assert sorted(runs.checkpoints) == sorted(CASES), [m for _, m in first.best_checkpoints]
        for workers, tag in ((3, "wider"), (1, "narrower")):
            cases = [case for case in CASES if (workers, tag) in RESIZES[case]]
            started = time.monotonic()
            fit(storage, tag, [case_config(runs, case, tag, steps=STEPS[case] + 2,
                                           resume_from=runs.checkpoints[case].path) for case in cases],
                workers=workers)  # fmt: skip
            runs.seconds[tag] = time.monotonic() - started
    except Exception as exc:  # each case's test fails with it, naming the case that broke the fit where it can
        runs.error = f"{type(exc).__name__}: {exc}"
    print(f"strategy fits: {runs.seconds}")
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_strategy_trains_checkpoints_and_resumes(case: str, runs: Runs) -> None:
    assert runs.error is None, runs.error
    _, model = CASES[case]
    steps = STEPS[case]
    out = runs.out / case
    records = json.loads((out / "first-records.json").read_text())
    gaps = sorted(b["time"] - a["time"] for a, b in zip(records, records[1:], strict=False))
    print(f"{case}: median step {gaps[len(gaps) // 2]:.3f}s (incl. report)")
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    # Loss goes down, over the whole dataset: each record is one rank's micro-batch, whose loss on the MLP's regression
    # varies 15-fold from batch to batch (its first and last two compared passed or failed with the step count).
    before = torch.load(out / "first-final.pt")
    assert full_loss(model, before) < full_loss(model), [r["loss"] for r in records]

    checkpoint = runs.checkpoints[case]
    with checkpoint.as_directory() as local:
        manifest = verify(local)
        assert manifest["step"] == steps
        assert (Path(local) / MANIFEST).is_file()
        assert any(name.startswith("rng-rank1") for name in manifest["files"])  # rank 1's files are covered too

    # Runs started from that checkpoint, as shunter's `checkpoint.resume_from` does, at another world size each: DDP
    # loads rank 0's state everywhere, FSDP2's DCP reshards, DeepSpeed goes through a universal checkpoint
    # (workers.checkpoint._load_deepspeed_resized).
    for workers, tag in RESIZES[case]:
        after = torch.load(out / f"{tag}-restored.pt")
        assert before.keys() == after.keys()
        for key in before:
            assert torch.equal(before[key], after[key]), (tag, key)
        later = json.loads((out / f"{tag}-records.json").read_text())
        assert [r["step"] for r in later] == [steps + 1, steps + 2], tag
        # Loss over the whole dataset (each record is one rank's micro-batch: too noisy to compare across runs).
        start, trained, on = (
            full_loss(model),
            full_loss(model, before),
            full_loss(model, torch.load(out / f"{tag}-final.pt")),
        )
        print(f"{case} resumed at {workers}: loss {start:.4f} at start, {trained:.4f} at the switch, {on:.4f} after")
        assert on < trained < start, (tag, start, trained, on)
        check_data_position(out, "first", tag, workers, model)


def reads(tmp_path: Path, tag: str) -> list[list[int]]:
    """Every micro-batch any rank of run `tag` read: [epoch, sample indices...]."""
    return [b for f in sorted(tmp_path.glob(f"{tag}-samples-rank*.json")) for b in json.loads(f.read_text())]


def check_data_position(tmp_path: Path, first: str, tag: str, workers: int, model: str) -> None:
    """The resumed run reads on from the samples the first one had read of its last epoch: none skipped, and fewer
    than one batch per rank read again. The order is the DistributedSampler's permutation (seed 0 + epoch) at every
    world size, 1 included (workers.strategies.common.distributed_loader)."""
    n, batch = len(tiny_data(model)), 4
    done = reads(tmp_path, first)
    epoch = max(b[0] for b in done)
    seen = {i for b in done if b[0] == epoch for i in b[1:]}
    order = torch.randperm(n, generator=torch.Generator().manual_seed(epoch)).tolist()
    assert seen == set(order[: len(seen)]), "the first run read a prefix of the epoch's permutation"
    again = {i for b in reads(tmp_path, tag) if b[0] == epoch for i in b[1:]}
    assert again, f"{tag}: read nothing of epoch {epoch}"
    assert min(order.index(i) for i in again) <= len(seen), f"{tag}: samples of epoch {epoch} were skipped"
    assert len(seen & again) < workers * batch, f"{tag}: {len(seen & again)} samples read twice"
