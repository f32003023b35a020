"""Each way of bringing training code, named in the spec and run through the real service: nothing else to change.
The jobs run side by side (`Scenarios`), each test reporting its own scenario."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import yaml

from service.backends.ray_local import LocalHead
from tests.service.conftest import Scenarios, Service

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


SCENARIOS = Scenarios()  # the module's jobs run side by side, two at a time (issue 34); each test reports its own


def scratch(service: Service, name: str) -> Path:
    """A scenario's own folder (they run at once, so none has a test's `tmp_path`)."""
    path = service.data_dir / "scratch" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def example(name: str, **config: object) -> dict:
    spec = yaml.safe_load((EXAMPLES / name).read_text())
    spec["config"] = {**spec.get("config", {}), **config}
    return spec


@SCENARIOS.add
def full_deepspeed_config_job_runs_and_does_not_hold_up_the_next(service: Service, submitted: threading.Event) -> None:
    """Issue 11's curl, as sent: a full DeepSpeed config (ZeRO-3). It used to stop admission for every job. The next
    job is the ZeRO-3 example (`examples/gpt2-zero3.yaml`: the `zero_stage` shorthand), which trains, checkpoints and
    seals its checkpoints beside it."""
    curl = {"entrypoint": {"callable": "examples.gpt2_tiny:train_loop"}, "config": {"steps": 6},
            "strategy": {"kind": "deepspeed", "deepspeed": {"config": {"zero_optimization": {"stage": 3}}}},
            "resources": {"num_workers": 2}}  # fmt: skip
    with service.client() as c:
        ds = c.submit(curl)
        after = c.submit(example("gpt2-zero3.yaml", steps=12, checkpoint_every=6))
        submitted.set()
        ds_job = c.wait(ds.id, timeout=300)
        assert ds_job.state == "SUCCEEDED", ds_job.last_error
        assert "[shunter] deepspeed: ZeRO stage 3" in c.logs(ds.id)
        # ZeRO-3 shards the model states too: one file per rank (stages 0-2 write a single mp_rank_00 file).
        states = Path(ds_job.latest_checkpoint, "deepspeed", "shunter")
        assert {p.name for p in states.glob("zero_pp_rank_*_mp_rank_00_model_states.pt")} == {
            f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in (0, 1)
        }
        job = c.wait(after.id, timeout=300)
        assert job.state == "SUCCEEDED", job.last_error
        losses = [m.value for m in c.metrics(job.id, name="loss")]
        assert len(losses) == 12 and losses[-1] < losses[0]
        ckpts = c.checkpoints(job.id)
        assert [k.step for k in ckpts] == [6, 12] and all(k.complete for k in ckpts)
        assert Path(job.latest_checkpoint, "shunter-manifest.json").is_file()


@SCENARIOS.add
def fsdp_job_via_rest(service: Service, submitted: threading.Event) -> None:
    with service.client() as c:
        job_id = c.submit(example("gpt2-fsdp.yaml", steps=8, checkpoint_every=4)).id
        submitted.set()
        job = c.wait(job_id, timeout=300)
        assert job.state == "SUCCEEDED", job.last_error
        losses = [m.value for m in c.metrics(job.id, name="loss")]
        assert losses[-1] < losses[0]
        assert Path(job.latest_checkpoint, "shunter-manifest.json").is_file()


@SCENARIOS.add
def unchanged_torchrun_script_via_rest(service: Service, submitted: threading.Event) -> None:
    """Every rank's script process gets torchrun's environment: its rank, the world, one rendezvous, the run id."""
    spec = example("torchrun-ddp.yaml")
    tmp_path = scratch(service, "torchrun")
    spec["entrypoint"]["args"] += ["--env-out", str(tmp_path)]
    with service.client() as c:
        job_id = c.submit(spec).id
        submitted.set()
        job = c.wait(job_id, timeout=300)
        assert job.state == "SUCCEEDED", job.last_error
        logs = c.logs(job.id)
        assert "[shunter] rank 0/2" in logs and "[shunter] rank 1/2" in logs
        assert "Epoch 1 complete" in logs  # the script's own output, from rank 0
    envs = [json.loads((tmp_path / f"env-rank{rank}.json").read_text()) for rank in range(2)]
    assert [e["RANK"] for e in envs] == ["0", "1"]
    assert {e["WORLD_SIZE"] for e in envs} == {"2"} and {e["LOCAL_WORLD_SIZE"] for e in envs} == {"2"}
    assert {e["GROUP_RANK"] for e in envs} == {"0"}
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
    assert {e["TORCHELASTIC_RUN_ID"] for e in envs} == {job.id}


@SCENARIOS.add
def unchanged_deepspeed_script_via_rest(service: Service, submitted: threading.Event) -> None:
    with service.client() as c:
        job_id = c.submit(example("deepspeed-script.yaml")).id
        submitted.set()
        job = c.wait(job_id, timeout=300)
        assert job.state == "SUCCEEDED", job.last_error
        assert "deepspeed epoch 1 complete, zero stage 2" in c.logs(job.id)


@SCENARIOS.add
def failing_script_fails_the_job(service: Service, submitted: threading.Event) -> None:
    """One rank's non-zero exit fails the job, although the other rank's script ended well."""
    script = scratch(service, "fails") / "fails.py"
    script.write_text("import os, sys\nprint('rank', os.environ['RANK'], flush=True)\n"
                      "sys.exit(3 if os.environ['RANK'] == '1' else 0)\n")  # fmt: skip
    with service.client() as c:
        job_id = c.submit({"name": "fails", "entrypoint": {"script": str(script)}, "resources": {"num_workers": 2}}).id
        submitted.set()
        job = c.wait(job_id, timeout=240)
        assert job.state == "FAILED" and job.end_reason == "user_error"
        assert "exited with code 3 on rank 1" in (job.last_error or ""), job.last_error


@SCENARIOS.add
def causal_lm_recipe_via_rest_saves_a_loadable_model(service: Service, submitted: threading.Event) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    with service.client() as c:
        job_id = c.submit(example("causal-lm.yaml", max_steps=6, checkpoint_every=3)).id
        submitted.set()
        job = c.wait(job_id, timeout=300)
        assert job.state == "SUCCEEDED", job.last_error
        assert (job.latest_metrics or {}).get("tokens_per_s", 0) > 0
        model_dir = service.data_dir / "checkpoints" / job.id / "model"
        model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
        assert model.config.n_layer == 2
        assert job.step == 6 and job.latest_checkpoint
        # It learned from its data: below an untrained model's ln(256) = 5.5 on a line of it.
        text = json.loads((EXAMPLES / "data" / "tiny.jsonl").read_text().splitlines()[0])["text"]
        ids = torch.tensor([list(text.encode())])
        loss = model(input_ids=ids, labels=ids).loss.item()
        assert loss < 5.0, loss


@pytest.fixture(scope="module")
def outcomes(module_service: Service, ray_head: LocalHead) -> Scenarios:
    """Every scenario above, run at once in their order (the queue holds each until two jobs' room is free on the
    head's 4 CPUs), and the module's service left with nothing running."""
    return SCENARIOS.run_on_module_service(module_service, ray_head)


def test_full_deepspeed_config_job_runs_and_does_not_hold_up_the_next(outcomes: Scenarios) -> None:
    outcomes.check("full_deepspeed_config_job_runs_and_does_not_hold_up_the_next")


def test_fsdp_job_via_rest(outcomes: Scenarios) -> None:
    outcomes.check("fsdp_job_via_rest")


def test_unchanged_torchrun_script_via_rest(outcomes: Scenarios) -> None:
    outcomes.check("unchanged_torchrun_script_via_rest")


def test_unchanged_deepspeed_script_via_rest(outcomes: Scenarios) -> None:
    outcomes.check("unchanged_deepspeed_script_via_rest")


def test_failing_script_fails_the_job(outcomes: Scenarios) -> None:
    outcomes.check("failing_script_fails_the_job")


def test_causal_lm_recipe_via_rest_saves_a_loadable_model(outcomes: Scenarios) -> None:
    outcomes.check("causal_lm_recipe_via_rest_saves_a_loadable_model")
