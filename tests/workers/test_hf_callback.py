"""An unchanged Hugging Face `Trainer` script reports its progress and checkpoints to shunter: the `sitecustomize` in
`workers.script_progress.SITE_DIR` adds `ShunterCallback` to its Trainer (real transformers, a tiny GPT-2 built from a
config, nothing downloaded), whose logs land as Metric rows through a live internal API at the true global step.
Outside shunter's script mode the hook is inert, and a user's own `sitecustomize` still runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from service.store.db import make_engine
from service.store.migrate import upgrade
from service.store.models import Job, JobState, Metric
from tests.live_api import add_attempt, live_api
from workers.script_progress import (
    ENV_SCRIPT_CONTROL,
    HF_CALLBACK_MARKER,
    SAVED_DIR,
    SITE_DIR,
    StdoutProgress,
    child_env,
    saved_checkpoints,
)

SECRET = "hf-callback-key-" + "k" * 24
REPO = Path(__file__).resolve().parents[2]

TRAIN = '''
"""A tiny Hugging Face Trainer script, as a user writes it (nothing downloaded: the model is built from a config)."""
import json
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

VOCAB, LENGTH = 64, 16


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n):
        self.ids = torch.randint(0, VOCAB, (n, LENGTH), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class MyTrainer(Trainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)


def main():
    output_dir, max_steps, flags = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=LENGTH, bos_token_id=0,
                        eos_token_id=0)
    args = TrainingArguments(output_dir=output_dir, max_steps=max_steps, logging_steps=1, save_steps=3,
                             per_device_train_batch_size=4, use_cpu=True, report_to=[], disable_tqdm=True)
    callbacks = None
    if "--own-callback" in flags:  # a script may add shunter's callback itself: it is not added twice
        from workers.hf_callback import ShunterCallback

        callbacks = [ShunterCallback()]
    cls = MyTrainer if "--subclass" in flags else Trainer
    trainer = cls(model=GPT2LMHeadModel(config), args=args, train_dataset=Tokens(32), callbacks=callbacks)
    trainer.train()
    print(json.dumps({"step": trainer.state.global_step, "script_done": 1}))
    print("CALLBACKS " + json.dumps([type(cb).__name__ for cb in trainer.callback_handler.callbacks]))


if __name__ == "__main__":
    main()
'''


@pytest.fixture
def sqlite_db(tmp_path: Path) -> Iterator[Engine]:
    """One database is enough here (the rows' way in is the same as in test_script_progress, on both)."""
    engine = make_engine(f"sqlite:///{tmp_path / 'shunter.db'}")
    upgrade(engine)
    yield engine
    engine.dispose()


def plain_env(**extra: str) -> dict[str, str]:
    """The test's environment without shunter's variables (nor a torchrun rank), with the checkout importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHUNTER_") and k not in ("RANK", "PYTHONPATH")}
    env.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra})
    return env


def running_job(db: Engine) -> Job:
    job = Job(name="hf", spec={"entrypoint": {"script": "train.py"}}, state=JobState.RUNNING, attempt=1)
    add_attempt(db, job)
    return job


def series(db: Engine, job_id: str, name: str) -> list[tuple[int | None, float]]:
    with Session(db) as session:
        rows = session.exec(select(Metric).where(Metric.job_id == job_id, Metric.name == name).order_by(col(Metric.id)))
        return [(m.step, m.value) for m in rows]


def run_script(script: Path, args: list[str], env: dict[str, str], progress: StdoutProgress | None = None) -> str:
    """Run the script as `workers.script` does (stdout and stderr merged, read line by line); its output."""
    proc = subprocess.Popen([sys.executable, "-u", str(script), *args], env=env, cwd=script.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    assert proc.stdout is not None
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if progress is not None:
                progress.feed(line)
        if progress is not None:
            assert progress.close(timeout=60)  # as workers.script does at the script's end
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = "".join(lines)
    assert code == 0, output[-4000:]
    return output


def callbacks_of(output: str) -> list[str]:
    line = next(line for line in output.splitlines() if line.startswith("CALLBACKS "))
    return list(json.loads(line.removeprefix("CALLBACKS ")))


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "job" / "train.py"
    path.parent.mkdir()
    path.write_text(TRAIN)
    return path


def test_an_unchanged_trainer_script_reports_through_the_callback(
    sqlite_db: Engine, tmp_path: Path, script: Path
) -> None:
    job = running_job(sqlite_db)
    control = tmp_path / "control"
    with live_api(sqlite_db, tmp_path, progress_secret=SECRET) as api:
        env = child_env(plain_env(**api.job_env(job.id), RANK="0"), control)
        progress = StdoutProgress(api.attempt_api(job.id), control_dir=control)  # as the parent reads rank 0
        output = run_script(script, ["out", "6"], env, progress)
    assert callbacks_of(output).count("ShunterCallback") == 1
    # every log at its global step, once: the printed log dicts were left to the callback
    assert [step for step, _ in series(sqlite_db, job.id, "loss")] == [1, 2, 3, 4, 5, 6]
    assert [step for step, _ in series(sqlite_db, job.id, "learning_rate")] == [1, 2, 3, 4, 5, 6]
    assert [step for step, _ in series(sqlite_db, job.id, "train_loss")] == [6]
    assert series(sqlite_db, job.id, "script_done") == [(6, 1.0)]  # the script's own JSON line, from stdout
    assert progress.reported == 1
    assert (control / HF_CALLBACK_MARKER).is_file()
    checkpoints = script.parent / "out"
    assert sorted(p.name for p in (control / SAVED_DIR).iterdir()) == ["checkpoint-3@0", "checkpoint-6@0"]
    assert saved_checkpoints(control, local_ranks=2) == {}  # a node with two ranks waits for the other's mark
    assert saved_checkpoints(control) == {
        "checkpoint-3": checkpoints / "checkpoint-3",
        "checkpoint-6": checkpoints / "checkpoint-6",
    }
    assert all(
        path.is_absolute() and (path / "trainer_state.json").is_file() for path in saved_checkpoints(control).values()
    )
    with Session(sqlite_db) as session:
        assert session.get(Job, job.id).step == 6  # type: ignore[union-attr]


def test_outside_script_mode_the_hook_is_inert(sqlite_db: Engine, tmp_path: Path, script: Path) -> None:
    """No SHUNTER_SCRIPT_CONTROL: a plain run, no callback, no markers; the printed log dicts are then the progress
    (the parent's reader, with a control dir the child never heard of, reports them at their index)."""
    job = running_job(sqlite_db)
    control = tmp_path / "control"
    control.mkdir()
    env = plain_env(PYTHONPATH=os.pathsep.join([str(SITE_DIR), str(REPO)]))
    with live_api(sqlite_db, tmp_path, progress_secret=SECRET) as api:
        progress = StdoutProgress(api.attempt_api(job.id), control_dir=control)
        output = run_script(script, ["out", "3"], env, progress)
    assert "ShunterCallback" not in callbacks_of(output)
    assert "shunter:" not in output
    assert list(control.iterdir()) == []
    assert (script.parent / "out" / "checkpoint-3").is_dir()
    assert [step for step, _ in series(sqlite_db, job.id, "loss")] == [1, 2, 3]  # 3 log dicts, then the summary
    assert [step for step, _ in series(sqlite_db, job.id, "train_loss")] == [4]
    assert progress.reported == 5


def test_the_hook_never_breaks_the_script_nor_adds_the_callback_twice(tmp_path: Path, script: Path) -> None:
    """A control dir that cannot be written (a file stands there), a Trainer subclass and a callback the script
    added itself: the run succeeds, with one callback, and says what it could not do."""
    blocked = tmp_path / "control"
    blocked.write_text("not a directory")
    env = plain_env(**{ENV_SCRIPT_CONTROL: str(blocked), "PYTHONPATH": os.pathsep.join([str(SITE_DIR), str(REPO)])})
    output = run_script(script, ["out", "3", "--subclass", "--own-callback"], env)
    assert callbacks_of(output).count("ShunterCallback") == 1
    assert "could not mark the Trainer callback" in output
    assert "could not mark checkpoint" in output
    assert (script.parent / "out" / "checkpoint-3").is_dir()
    assert blocked.read_text() == "not a directory"


PROBE = """
import json, sys
import sitecustomize
hooked = [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "TrainerHook"]
chained = getattr(sitecustomize.CHAINED, "__file__", None)
heavy = sorted(m for m in ("transformers", "torch", "workers", "httpx") if m in sys.modules)
print(json.dumps({"ours": sitecustomize.__file__, "chained": chained, "hooked": hooked, "heavy": heavy}))
"""


def probe(env: dict[str, str]) -> tuple[dict[str, object], str]:
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.mark.parametrize("script_mode", [True, False])
def test_a_users_own_sitecustomize_still_runs(tmp_path: Path, script_mode: bool) -> None:
    user_site = tmp_path / "user-site"
    user_site.mkdir()
    mark = tmp_path / "user-site-ran"
    (user_site / "sitecustomize.py").write_text(f"open({str(mark)!r}, 'a').write(__name__ + '\\n')\n")
    env = plain_env(PYTHONPATH=os.pathsep.join([str(SITE_DIR), str(REPO), str(user_site)]))
    if script_mode:
        env[ENV_SCRIPT_CONTROL] = str(tmp_path / "control")
    seen, stderr = probe(env)
    assert seen["ours"] == str(SITE_DIR / "sitecustomize.py")
    assert seen["chained"] == str(user_site / "sitecustomize.py")
    assert mark.read_text() == "sitecustomize\n"  # run once, under its own name
    assert seen["hooked"] == (["TrainerHook"] if script_mode else [])
    assert seen["heavy"] == []  # nothing imported until the script imports transformers itself
    assert stderr == ""


def test_a_failing_user_sitecustomize_is_noted_and_the_script_runs(tmp_path: Path) -> None:
    user_site = tmp_path / "user-site"
    user_site.mkdir()
    (user_site / "sitecustomize.py").write_text("raise RuntimeError('broken user site')\n")
    env = plain_env(PYTHONPATH=os.pathsep.join([str(SITE_DIR), str(user_site)]), **{ENV_SCRIPT_CONTROL: "/nowhere"})
    seen, stderr = probe(env)
    assert seen["hooked"] == ["TrainerHook"]
    assert seen["chained"] is None
    assert stderr.strip() == "shunter: the next sitecustomize failed: RuntimeError: broken user site"


def test_without_a_users_sitecustomize_nothing_is_chained(tmp_path: Path) -> None:
    seen, stderr = probe(plain_env(PYTHONPATH=str(SITE_DIR)))
    assert seen["chained"] is None or not str(seen["chained"]).startswith(str(SITE_DIR))
    assert stderr == ""


def test_a_drain_notice_saves_at_that_step_and_ends_training(tmp_path: Path, script: Path) -> None:
    """The notice its Ray worker passed on (`workers.drain.DRAIN_FILE`) makes the Trainer save at the step it is at
    and end training there, off its save schedule (every 3 steps), and mark `drained` with that step, from which the
    worker stops the attempt as `node_draining`."""
    from workers.drain import DRAIN_FILE, NodeDraining, script_stopped

    control = tmp_path / "control"
    control.mkdir()
    (control / DRAIN_FILE).write_text(json.dumps({"nodes": ["ab" * 8], "ranks": [1], "deadline_ms": 2_000,
                                                  "seen_ms": 1_000}))  # fmt: skip
    output = run_script(script, ["out", "20"], child_env(plain_env(RANK="0"), control))
    assert json.loads(next(line for line in output.splitlines() if '"script_done"' in line))["step"] == 1
    assert sorted(p.name for p in (control / SAVED_DIR).iterdir()) == ["checkpoint-1@0"]
    assert (script.parent / "out" / "checkpoint-1" / "trainer_state.json").is_file()
    stopped = script_stopped(control)
    assert isinstance(stopped, NodeDraining) and stopped.step == 1
    assert "1s before its deadline" in str(stopped) and "at step 1" in str(stopped)


def test_without_a_notice_the_script_trains_to_its_end_and_is_not_stopped(tmp_path: Path, script: Path) -> None:
    from workers.drain import script_stopped

    control = tmp_path / "control"
    run_script(script, ["out", "4"], child_env(plain_env(RANK="0"), control))
    assert script_stopped(control) is None
    assert sorted(p.name for p in (control / SAVED_DIR).iterdir()) == ["checkpoint-3@0", "checkpoint-4@0"]


def test_a_rank_whose_own_notice_came_late_still_stops_where_the_others_did(tmp_path: Path) -> None:
    """The ranks agree on a notice when any rank's worker passed it on: a rank can save and end before its own worker
    wrote `DRAIN_FILE`. It must still stop the attempt (CI: rank 0 went on to Ray Train's end-of-run barrier, which the
    stopped ranks never reach, and the attempt hung until the node's deadline)."""
    from workers.drain import DRAIN_FILE, NodeDraining, mark_script_drained, script_stopped

    control = tmp_path / "control"
    control.mkdir()
    mark_script_drained(control, 17)
    assert not (control / DRAIN_FILE).exists()
    stopped = script_stopped(control, patience_s=0.2)  # outside Ray Train: no copy of the notice comes
    assert isinstance(stopped, NodeDraining) and stopped.step == 17 and stopped.notice == {}
    assert "at step 17" in str(stopped)
