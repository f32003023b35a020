"""Pure tests: what the strategy part of the spec refuses at submission, and how "auto" is resolved."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from service.spec.job import JobSpec
from service.spec.strategy import MixedPrecision, StrategySpec
from workers.checkpoint import MANIFEST, IncompleteCheckpointError, verify
from workers.script import run_script
from workers.strategies.deepspeed import build_config
from workers.train_loop import Token, UserCallable, run_loop, train_loop_for

GUIDE_DS_CONFIG = {  # the reference guide's ds_config.json, minus bf16 (CPU here)
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "none"},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e7,
        "stage3_prefetch_bucket_size": 5e7,
        "stage3_param_persistence_threshold": 1e5,
    },
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}


def spec(strategy: dict[str, Any], *, use_gpu: bool = False, workers: int = 2) -> JobSpec:
    return JobSpec.model_validate(
        {
            "entrypoint": {"callable": "examples.gpt2_tiny:train_loop"},
            "strategy": strategy,
            "resources": {"num_workers": workers, "use_gpu": use_gpu},
        }
    )


@pytest.mark.parametrize(
    ("strategy", "use_gpu", "message"),
    [
        ({"mixed_precision": "bf16"}, False, "strategy.mixed_precision=bf16 needs GPUs"),
        ({"kind": "ddp", "fsdp": {}}, False, "fsdp options given but kind is ddp"),
        ({"kind": "deepspeed", "deepspeed": {"zero_stage": 2, "offload_param": "cpu"}}, False, "needs zero_stage: 3"),
        ({"kind": "deepspeed", "deepspeed": {"zero_stage": 0, "offload_optimizer": "cpu"}}, False, "stage 1, 2 or 3"),
        ({"kind": "deepspeed", "deepspeed": {"zero_stage": 3, "config": {}}}, False, "not both"),
        ({"kind": "fsdp", "fsdp": {"sharding": "hybrid_shard", "shard_size": 3}}, False, "does not divide"),
        ({"kind": "fsdp", "fsdp": {"shard_size": 2}}, False, "only meaningful with sharding: hybrid_shard"),
        (
            {
                "kind": "deepspeed",
                "micro_batch_size": 4,
                "deepspeed": {"config": {"train_micro_batch_size_per_gpu": 8}},
            },
            False,
            "train_micro_batch_size_per_gpu: 8 contradicts strategy.micro_batch_size",
        ),
        (
            {"kind": "deepspeed", "micro_batch_size": 4, "deepspeed": {"config": {"train_batch_size": 16}}},
            False,
            "strategy.deepspeed.config.train_batch_size: 16 != micro batch 4 x gradient accumulation 1 x 2 workers",
        ),
        (
            {"kind": "deepspeed", "gradient_accumulation_steps": 2, "deepspeed": {"config": GUIDE_DS_CONFIG}},
            False,
            "gradient_accumulation_steps: 4 contradicts",
        ),
        (
            {"kind": "deepspeed", "deepspeed": {"config": {"train_batch_size": "lots"}}},
            False,
            'train_batch_size: must be a positive integer or "auto"',
        ),
        ({"kind": "deepspeed", "deepspeed": {"config": {"bf16": {"enabled": True}}}}, False, "bf16 needs GPUs"),
        (
            {
                "kind": "deepspeed",
                "deepspeed": {"config": {"zero_optimization": {"stage": 1, "offload_param": {"device": "cpu"}}}},
            },
            False,
            "offload_param: needs stage 3",
        ),
    ],
)
def test_spec_refuses_strategies_that_cannot_work(strategy: dict[str, Any], use_gpu: bool, message: str) -> None:
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        spec(strategy, use_gpu=use_gpu)


def test_spec_accepts_workable_strategies() -> None:
    spec({"kind": "deepspeed", "deepspeed": {"config": GUIDE_DS_CONFIG}})
    spec(
        {
            "kind": "deepspeed",
            "micro_batch_size": 2,
            "deepspeed": {"config": {**GUIDE_DS_CONFIG, "train_batch_size": 16}},
        }
    )
    spec(
        {"kind": "fsdp", "mixed_precision": "bf16", "fsdp": {"sharding": "hybrid_shard", "shard_size": 4}},
        use_gpu=True,
        workers=8,
    )
    spec({"kind": "fsdp", "mixed_precision": "auto"})  # falls back to no on CPU
    spec({"kind": "ddp", "scale_lr": "linear", "base_batch_size": 32})


def test_auto_mixed_precision_falls_back_on_cpu() -> None:
    strategy = StrategySpec(mixed_precision=MixedPrecision.auto)
    assert strategy.resolved_mixed_precision(use_gpu=False) is MixedPrecision.no
    assert strategy.resolved_mixed_precision(use_gpu=True) is MixedPrecision.bf16
    assert strategy.resolved_mixed_precision(use_gpu=True, bf16_supported=False) is MixedPrecision.fp16


def test_deepspeed_auto_values_resolve_from_spec() -> None:
    strategy = spec({"kind": "deepspeed", "micro_batch_size": 2, "deepspeed": {"config": GUIDE_DS_CONFIG}}).strategy
    config = build_config(strategy, world_size=2, micro_batch_size=None, precision=MixedPrecision.no, use_gpu=False)
    assert config["train_micro_batch_size_per_gpu"] == 2
    assert config["gradient_accumulation_steps"] == 4
    assert config["train_batch_size"] == 16
    assert GUIDE_DS_CONFIG["train_batch_size"] == "auto"  # the user's config is not modified


def test_deepspeed_short_form_builds_zero_config() -> None:
    strategy = spec(
        {"kind": "deepspeed", "gradient_clipping": 1.0, "deepspeed": {"zero_stage": 3, "offload_param": "cpu"}}
    ).strategy
    config = build_config(strategy, world_size=4, micro_batch_size=8, precision=MixedPrecision.bf16, use_gpu=True)
    assert config["zero_optimization"]["stage"] == 3
    assert config["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert config["train_batch_size"] == 32 and config["gradient_clipping"] == 1.0
    assert config["bf16"] == {"enabled": True} and config["fp16"] == {"enabled": False}


def test_train_loop_for_callable_and_script(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHUNTER_ATTEMPT_TOKEN", "sat1.the-drivers-token")  # what the driver got for its bootstrap
    loop, config = train_loop_for(
        JobSpec.model_validate({"entrypoint": {"callable": "examples.gpt2_tiny:train_loop"}, "config": {"steps": 3}})
    )
    from examples.gpt2_tiny import train_loop

    # The job's own loop, run by shunter's wrapper (which first reports the checkpoint Ray Train restored, if any),
    # and imported by it on the workers: it is named here, not imported (nor torch with it).
    checks = {"enabled": True, "slow_factor": 4.0, "timeout_seconds": 60.0}  # the spec's default pre-flight check
    assert loop.func is run_loop and config == {"steps": 3}
    token = Token("sat1.the-drivers-token")  # the attempt token rides with the loop: a Ray task argument
    assert loop.keywords == {"loop": UserCallable("examples.gpt2_tiny:train_loop"), "announce": True,
                             "preflight": checks, "token": token}  # fmt: skip
    assert "the-drivers-token" not in repr(loop)  # nor shown where the partial is printed
    assert loop.keywords["loop"].resolve() is train_loop
    loop, config = train_loop_for(JobSpec.model_validate({"entrypoint": {"script": "x.py", "args": ["--a", "1"]}}))
    assert loop.keywords == {"loop": run_script, "announce": False, "preflight": checks, "token": token}
    assert config == {"script": "x.py", "args": ["--a", "1"], "outputs": [], "resume_arg": None}


def test_the_wrapper_calls_the_loop_as_ray_train_would(monkeypatch: pytest.MonkeyPatch) -> None:
    import workers.progress

    monkeypatch.setattr(workers.progress, "report_restored", lambda: None)  # no Ray Train session here
    monkeypatch.setattr(workers.progress, "announce_started", lambda **_: None)
    finished: list[int] = []  # each loop that returned says so: the attempt succeeds on it (in a Train session)
    monkeypatch.setattr(workers.progress, "announce_finished", lambda: finished.append(1))
    calls: list[object] = []
    assert run_loop({"a": 1}, loop=lambda config: calls.append(config)) is None
    assert run_loop({"a": 2}, loop=lambda: calls.append("no config")) is None
    assert run_loop({"a": 3}, loop=lambda *args: calls.append(args)) is None
    assert run_loop({"a": 4}, loop=lambda config, extra=1: config["a"] + extra) == 5
    assert calls == [{"a": 1}, "no config", ({"a": 3},)]
    assert len(finished) == 4


def test_a_bad_callable_fails_where_it_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """A missing module fails the driver at once, before any worker starts; a missing or uncallable attribute fails
    each rank as its loop starts (the workers import the job's code): both are the user's error."""
    import workers.progress

    with pytest.raises(ModuleNotFoundError, match="no module named 'examples.nope'"):
        train_loop_for(JobSpec.model_validate({"entrypoint": {"callable": "examples.nope:train_loop"}}))
    with pytest.raises(ModuleNotFoundError):
        train_loop_for(JobSpec.model_validate({"entrypoint": {"callable": "nopackage.mod:train_loop"}}))
    monkeypatch.setattr(workers.progress, "report_restored", lambda: None)  # no Ray Train session here
    monkeypatch.setattr(workers.progress, "announce_started", lambda **_: None)
    for target, error in (("examples.mlp:nope", AttributeError), ("examples.mlp:__doc__", TypeError)):
        loop, config = train_loop_for(JobSpec.model_validate({"entrypoint": {"callable": target}}))
        with pytest.raises(error):
            loop(config, preflight=None)


def test_checkpoint_without_valid_manifest_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model.pt").write_bytes(b"weights")
    with pytest.raises(IncompleteCheckpointError, match="no shunter-manifest.json"):
        verify(tmp_path)
    entry = {"size": 7, "sha256": "0" * 64}
    (tmp_path / MANIFEST).write_text(json.dumps({"step": 1, "files": {"model.pt": entry}}))
    with pytest.raises(IncompleteCheckpointError, match="does not match its sha256"):
        verify(tmp_path)


def test_deepspeed_config_from_stored_spec_keeps_its_stage() -> None:
    """Issue 11: a full config (stage 3) must survive the spec's dump / re-validation and still build stage 3."""
    submitted = JobSpec.model_validate(
        {
            "entrypoint": {"callable": "examples.gpt2_tiny:train_loop"},
            "config": {"steps": 6},
            "strategy": {"kind": "deepspeed", "deepspeed": {"config": {"zero_optimization": {"stage": 3}}}},
            "resources": {"num_workers": 2},
        }
    )
    stored = JobSpec.model_validate_json(submitted.model_dump_json())  # what the driver validates
    assert stored == submitted
    config = build_config(stored.strategy, world_size=2, micro_batch_size=4, precision=MixedPrecision.no, use_gpu=False)
    assert config["zero_optimization"]["stage"] == 3
    assert config["gradient_accumulation_steps"] == 1 and config["train_batch_size"] == 8


def test_deepspeed_short_form_defaults_survive_the_dump() -> None:
    """Defaults not given (ZeRO 2, no offload, no overlap, accumulation 1) are applied by the worker, not stored."""
    submitted = spec({"kind": "deepspeed"})
    stored = JobSpec.model_validate(submitted.model_dump(mode="json"))
    assert stored == submitted and stored.strategy.deepspeed_options.zero_stage is None
    config = build_config(stored.strategy, world_size=2, micro_batch_size=4, precision=MixedPrecision.no, use_gpu=False)
    assert config["zero_optimization"] == {"stage": 2, "overlap_comm": False, "contiguous_gradients": True}
    assert config["gradient_accumulation_steps"] == 1 and config["train_batch_size"] == 8


def test_a_script_rendezvous_port_is_outside_the_range_the_kernel_hands_out() -> None:
    """Rank 0's Ray worker picks the script's rendezvous port; the script's own process binds it seconds later. A port
    from the kernel's ephemeral range could meanwhile go to any outgoing connection of the node (the race the
    session-head ports had, `tests/deploy/test_local_head.py`): the pick is below that range, and free on every
    address."""
    import socket

    from service.backends import ray_local
    from workers.script import rendezvous_port

    low = ray_local._ephemeral_low()
    picks = [rendezvous_port() for _ in range(50)]
    assert all(ray_local.PICK_LOW <= p < low for p in picks), picks
    with socket.socket() as sock:  # free on every address: rank 0's node address included
        sock.bind(("0.0.0.0", picks[0]))
