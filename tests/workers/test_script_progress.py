"""A script-mode job's progress from its stdout (`workers.script_progress`), and `from workers import report` in a
user's script: parsed lines become Metric rows through the real internal API, at the right steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from service.backends.ray_local import free_port
from service.store.models import Job, JobState, Metric
from service.tenancy import attempt_tokens
from tests.conftest import wait_for
from tests.live_api import add_attempt, live_api
from tests.service import conftest as service_fixtures
from workers.attempt_api import AttemptApi, AttemptApiError, transient
from workers.script_progress import HF_CALLBACK_MARKER, MAX_LINE_CHARS, StdoutProgress, parse_line

db = service_fixtures.db  # the fixture: a SQLite file, or a fresh PostgreSQL database
SECRET = "script-progress-key-" + "k" * 24
SPEC = {"entrypoint": {"script": "train.py"}}
REPO = Path(__file__).resolve().parents[2]
HF_LINE = "{'loss': '3.919', 'grad_norm': '1.321', 'learning_rate': '5e-05', 'epoch': '0.125'}"  # transformers 5

PARSED = [
    # the documented JSON line
    ('{"step": 3, "loss": 0.5}', {"step": 3, "loss": 0.5}),
    ('  {"step": 3.0, "loss": 1}  \n', {"step": 3, "loss": 1}),
    ('{ "loss": 2.5, "step": 0 }', {"step": 0, "loss": 2.5}),
    (
        '{"step": 1, "loss": 0.5, "ok": true, "name": "x", "hist": [1, 2], "sub": {"a": 1}, "none": null}',
        {"step": 1, "loss": 0.5},
    ),
    ('{"step": 2, "loss": NaN, "acc": Infinity, "neg": -Infinity, "lr": 0.1}', {"step": 2, "lr": 0.1}),
    ('{"step": 2, "big": 1e999, "huge": ' + "9" * 400 + ', "lr": 0.1}', {"step": 2, "lr": 0.1}),
    (f'{{"step": {2**31 - 1}}}', {"step": 2**31 - 1}),
    # Hugging Face Trainer's printed logs: older releases print floats, newer ones f"{v:.4g}" strings
    (
        "{'loss': 2.31, 'grad_norm': 1.2, 'learning_rate': 4.9e-05, 'epoch': 0.33}",
        {"loss": 2.31, "grad_norm": 1.2, "learning_rate": 4.9e-05, "epoch": 0.33},
    ),
    (HF_LINE, {"loss": 3.919, "grad_norm": 1.321, "learning_rate": 5e-05, "epoch": 0.125}),
    (
        "{'eval_loss': 2.0, 'eval_runtime': 0.5, 'eval_samples_per_second': 64.0, 'epoch': 1.0}",
        {"eval_loss": 2.0, "eval_runtime": 0.5, "eval_samples_per_second": 64.0, "epoch": 1.0},
    ),
    (
        "{'train_runtime': '0.3053', 'train_steps_per_second': '19.66', 'train_loss': '3.91', 'epoch': '0.75'}",
        {"train_runtime": 0.3053, "train_steps_per_second": 19.66, "train_loss": 3.91, "epoch": 0.75},
    ),
    ("{'loss': 'nan', 'grad_norm': 'inf', 'epoch': 1}", {"epoch": 1}),  # still a log dict: its index counts
    ("{'loss': 1.5, 'flag': True, 'note': 'hi', 1: 2.0, 'step': 9, 'hist': [1.0]}", {"loss": 1.5}),
    # a tqdm bar before the text (its carriage returns)
    ("\r 50%|█████     | 3/6 [00:01<00:02,  2.1it/s]\r" + HF_LINE, parse_line(HF_LINE)),
    ('  10%|#         | 1/10\r{"step": 5, "loss": 1.0}', {"step": 5, "loss": 1.0}),
    # a bar redrawn for minutes (no newline in between) makes one long line: the bound is on the text after it
    (
        "".join(f"\r {i}/100000 [00:{i % 60:02d}<01:00, 9.9it/s]" for i in range(5000)) + "\r" + HF_LINE,
        parse_line(HF_LINE),
    ),
]

NOT_PROGRESS = [
    "",
    "   ",
    "hello world",
    "step 3 loss 0.5",
    "{",
    "{not json}",
    "[1, 2]",
    '[{"step": 1, "loss": 1.0}]',
    "{}",
    '{"loss": 0.5}',  # JSON without a step
    '{"step": "3", "loss": 0.5}',
    '{"step": true, "loss": 0.5}',
    '{"step": -1, "loss": 0.5}',
    '{"step": 1.5, "loss": 0.5}',
    '{"step": NaN, "loss": 0.5}',
    f'{{"step": {2**31}, "loss": 0.5}}',
    '{"step": 1, "loss": 0.5} trailing',
    'loss: {"step": 1, "loss": 0.5}',
    "{'learning_rate': 0.1, 'epoch': 1.0}",  # a Python dict without a loss key
    "{'loss': np.float64(2.3), 'epoch': 1.0}",  # numpy reprs are calls, not literals
    "{'loss': float('nan')}",
    "{'loss': __import__('os').system('touch /tmp/pwned')}",  # never evaluated
    "{'loss': 1.0",
    '{"step": 1, "loss": 1.0}\r50%|#####',  # the bar after the text wins
    "{" * 5000 + "}" * 5000,
    '{"step": 1, "loss": 1.0, "pad": "' + "x" * MAX_LINE_CHARS + '"}',
    "{'loss': 1.0, 'pad': '" + "x" * MAX_LINE_CHARS + "'}",
]


@pytest.mark.parametrize(("line", "expected"), PARSED, ids=[repr(line[-40:]) for line, _ in PARSED])
def test_parse_line_reads_progress(line: str, expected: dict[str, float]) -> None:
    parsed = parse_line(line)
    assert parsed == expected
    assert parsed is not None and all(type(v) in (int, float) for v in parsed.values())
    assert "step" not in parsed or type(parsed["step"]) is int


@pytest.mark.parametrize("line", NOT_PROGRESS, ids=[repr(line[:40]) for line in NOT_PROGRESS])
def test_parse_line_ignores_anything_else(line: str) -> None:
    assert parse_line(line) is None


def test_a_long_line_under_the_bound_still_counts() -> None:
    line = '{"step": 1, "loss": 1.0, "pad": "' + "x" * (MAX_LINE_CHARS - 100) + '"}'
    assert parse_line(line) == {"step": 1, "loss": 1.0}


def running_job(db: Engine, state: JobState = JobState.RUNNING) -> Job:
    job = Job(name="script", spec=SPEC, state=state, attempt=1)
    add_attempt(db, job)
    return job


def series(db: Engine, job_id: str, name: str = "loss") -> list[tuple[int | None, float]]:
    with Session(db) as session:
        rows = session.exec(select(Metric).where(Metric.job_id == job_id, Metric.name == name).order_by(col(Metric.id)))
        return [(m.step, m.value) for m in rows]


def test_stdout_lines_become_metrics_at_their_steps(db: Engine, tmp_path: Path) -> None:
    job = running_job(db)
    with live_api(db, tmp_path, progress_secret=SECRET) as api:
        progress = StdoutProgress(api.attempt_api(job.id), control_dir=tmp_path / "control")
        lines = [
            "[rank0] starting",
            '{"step": 10, "loss": 2.0, "lr": 0.1}',
            "{'loss': '1.5', 'grad_norm': '1.0', 'learning_rate': '5e-05', 'epoch': '0.5'}",
            "not progress",
            "\r 40%|####      | 2/5\r{'loss': 1.25, 'epoch': 1.0}",
            '{"step": 20, "loss": NaN, "acc": 0.75}',
            "{'eval_loss': 1.0, 'epoch': 1.0}",
        ]
        results = [progress.feed(line) for line in lines]
        assert progress.close()  # every queued point sent before the API goes
    assert results == [False, True, True, False, True, True, True]
    assert progress.reported == 5 and progress.dropped == 0
    # JSON lines at their own steps; Trainer log dicts at their index among the log dicts (1, 2, 3)
    assert series(db, job.id) == [(10, 2.0), (1, 1.5), (2, 1.25)]
    assert series(db, job.id, "acc") == [(20, 0.75)]
    assert series(db, job.id, "eval_loss") == [(3, 1.0)]
    assert series(db, job.id, "lr") == [(10, 0.1)]
    assert series(db, job.id, "step") == []  # the step is the row's, not a metric
    with Session(db) as session:
        assert session.get(Job, job.id).step == 3  # type: ignore[union-attr]


def test_trainer_logs_are_left_to_the_callback_once_its_marker_exists(db: Engine, tmp_path: Path) -> None:
    job = running_job(db)
    control = tmp_path / "control"
    control.mkdir()
    with live_api(db, tmp_path, progress_secret=SECRET) as api:
        progress = StdoutProgress(api.attempt_api(job.id), control_dir=control)
        assert progress.feed("{'loss': 3.0, 'epoch': 0.1}")  # no callback yet: reported from stdout, index 1
        (control / HF_CALLBACK_MARKER).write_text("1\n")  # the child's ShunterCallback was made
        assert not progress.feed("{'loss': 2.0, 'epoch': 0.2}")
        assert progress.feed('{"step": 7, "loss": 1.0}')  # JSON lines are always reported
        (control / HF_CALLBACK_MARKER).unlink()
        assert not progress.feed("{'loss': 0.5, 'epoch': 0.3}")  # once seen, cached
        assert progress.close()
    assert series(db, job.id) == [(1, 3.0), (7, 1.0)]


def test_without_an_api_nothing_is_sent(tmp_path: Path) -> None:
    progress = StdoutProgress(None, control_dir=tmp_path)
    assert not progress.feed('{"step": 1, "loss": 1.0}')
    assert progress.reported == 0


def test_an_unreachable_api_never_stalls_the_script_and_its_points_are_dropped_at_the_end(tmp_path: Path) -> None:
    api = AttemptApi(f"http://127.0.0.1:{free_port()}", "token", "job", 1)  # nothing listens there
    progress = StdoutProgress(api, control_dir=tmp_path)
    started = time.monotonic()
    assert [progress.feed(f'{{"step": {i}, "loss": 1.0}}') for i in range(50)] == [True] * 50  # queued
    assert time.monotonic() - started < 5  # the reader never waits on the API (a refused connection each try)
    assert not progress.close(timeout=1.0)  # the end waits no longer than it is given
    assert progress.reported == 0 and progress.dropped == 50
    assert not progress.feed('{"step": 51, "loss": 1.0}')  # closed


def test_points_are_kept_while_the_api_is_away_and_arrive_in_order(db: Engine, tmp_path: Path) -> None:
    """The API down when the script prints (restarting, say): its points wait in the queue and are recorded, in order,
    once it is back; the script's last point, its final loss, included."""
    job = running_job(db)
    port = free_port()
    token = attempt_tokens.issue(job.id, 1, SECRET)
    progress = StdoutProgress(AttemptApi(f"http://127.0.0.1:{port}", token, job.id, 1), control_dir=tmp_path)
    assert all(progress.feed(f'{{"step": {i}, "loss": {1.0 / i}}}') for i in range(1, 21))
    wait_for(lambda: progress.failed_tries >= 2, timeout=60, what="the sender's tries while nothing listens")
    assert progress.reported == 0
    with live_api(db, tmp_path, port=port, progress_secret=SECRET):
        assert progress.close(timeout=60)
    assert progress.reported == 20 and progress.dropped == 0
    assert series(db, job.id) == [(i, 1.0 / i) for i in range(1, 21)]


def test_the_queue_is_bounded_and_keeps_the_newest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from workers import script_progress

    monkeypatch.setattr(script_progress, "MAX_PENDING", 5)
    api = AttemptApi(f"http://127.0.0.1:{free_port()}", "token", "job", 1)  # nothing listens there
    progress = StdoutProgress(api, control_dir=tmp_path)
    for i in range(1, 13):
        progress.feed(f'{{"step": {i}, "loss": 1.0}}')
    assert [step for _, step in progress._pending] == [8, 9, 10, 11, 12]
    assert progress.dropped == 7
    progress.close(timeout=0)


def test_a_fenced_attempt_stops_reporting(db: Engine, tmp_path: Path) -> None:
    job = running_job(db, JobState.SUCCEEDED)  # not active: the API answers `recorded: false`
    with live_api(db, tmp_path, progress_secret=SECRET) as api:
        progress = StdoutProgress(api.attempt_api(job.id), control_dir=tmp_path)
        assert progress.feed('{"step": 1, "loss": 1.0}')  # queued; the API answers `recorded: false`
        assert progress.close(timeout=60)  # nothing more to send to an attempt that is over
        assert progress._fenced and progress.reported == 0
        assert not progress.feed('{"step": 2, "loss": 1.0}')
    assert series(db, job.id) == []


# `from workers import report`, in a process of its own as a user's script is


def run_python(code: str, env: dict[str, str]) -> list[object]:
    """Run `code` with `env` (over a plain environment without shunter's variables); its last stdout line, as JSON."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("SHUNTER_") and k not in ("RANK", "PYTHONPATH")}
    base.update(PYTHONPATH=str(REPO), **env)
    done = subprocess.run([sys.executable, "-c", code], env=base, capture_output=True, text=True, timeout=60,
                          cwd=REPO)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


LIGHT = "import json, sys\nimport workers\nprint(json.dumps(sorted(m for m in {} if m in sys.modules)))"


def test_importing_workers_and_script_progress_stays_light() -> None:
    assert (
        run_python(LIGHT.format("('torch', 'httpx', 'pydantic', 'ray', 'transformers', 'workers.context')"), {}) == []
    )
    code = LIGHT.replace("import workers\n", "import workers.script_progress\n")
    assert run_python(code.format("('torch', 'ray', 'transformers', 'accelerate')"), {}) == []


REPORT = """
import json, sys
from workers import report
results = [report(loss=0.5), report(loss=0.25, lr=1e-4, note="x", flag=True), report(step=7, loss=0.125),
           report(step=-1, loss=1.0), report(step="x", loss=1.0), report(step=3, loss=float("nan"))]
print(json.dumps(results))
"""


def test_report_is_a_no_op_outside_shunter() -> None:
    assert run_python(REPORT, {}) == [False] * 6


def test_report_lands_metrics_from_rank_zero(db: Engine, tmp_path: Path) -> None:
    job = running_job(db)
    with live_api(db, tmp_path, progress_secret=SECRET) as api:
        assert run_python(REPORT, {**api.job_env(job.id), "RANK": "0"}) == [True, True, True, False, False, True]
    assert series(db, job.id) == [(1, 0.5), (2, 0.25), (7, 0.125)]  # no step: counted 1, 2, ...
    assert series(db, job.id, "lr") == [(2, 1e-4)]
    assert series(db, job.id, "note") == series(db, job.id, "flag") == []
    with Session(db) as session:
        assert session.get(Job, job.id).step == 3  # type: ignore[union-attr]


def test_report_sends_nothing_from_other_ranks(db: Engine, tmp_path: Path) -> None:
    job = running_job(db)
    with live_api(db, tmp_path, progress_secret=SECRET) as api:
        assert run_python(REPORT, {**api.job_env(job.id), "RANK": "1"}) == [False] * 6
    assert series(db, job.id) == []


def test_report_never_raises_when_the_api_is_away() -> None:
    attempt_env = {"SHUNTER_PROGRESS_URL": f"http://127.0.0.1:{free_port()}", "SHUNTER_ATTEMPT_TOKEN": "not-a-token",
                   "SHUNTER_JOB_ID": "job", "SHUNTER_ATTEMPT": "1"}  # fmt: skip
    assert run_python(REPORT, attempt_env) == [False] * 6


@pytest.mark.parametrize(("status", "again"), [(500, True), (502, True), (503, True), (504, True), (404, False),
                                               (409, False), (422, False), (429, False)])  # fmt: skip
def test_an_answer_the_api_may_give_otherwise_later_is_transient(status: int, again: bool) -> None:
    """`AttemptApi` raises `AttemptApiError` for an answer (not httpx's error): a 503 from an API whose database is away
    is still tried again, by this module's sender and by the Train reporter's outbox (workers.progress)."""
    assert transient(AttemptApiError(f"POST report: {status}", status)) is again
