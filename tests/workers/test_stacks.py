"""The stack dump's node side (workers.stacks), on real processes: a process that registered the handler prints every
thread's stack on SIGUSR1 and lives on; one that did not is never signalled (SIGUSR1 would end it); a child counts
only when it belongs to the job."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import wait_for
from workers.stacks import catches, children_of, signal_ranks

REPO = Path(__file__).resolve().parents[2]
WORKER = """
import os, subprocess, sys, time
from workers.stacks import register
register()
env = dict(os.environ, SHUNTER_JOB_ID=sys.argv[1])
mine = [sys.executable, "-c", "import faulthandler, signal, time\\n"
        "faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)\\n"
        "def child_waits_here():\\n    time.sleep(600)\\nchild_waits_here()"]
other = [sys.executable, "-c", "import time; time.sleep(600)"]
kids = [subprocess.Popen(mine, env=env, stderr=open(sys.argv[2], "w")), subprocess.Popen(other, env=env),
        subprocess.Popen(mine, env=dict(os.environ, SHUNTER_JOB_ID="someone-else"))]
print(" ".join(str(k.pid) for k in kids), flush=True)
def worker_waits_here():
    time.sleep(600)
worker_waits_here()
"""


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], list[int], Path]]:
    """A stand-in train worker (registered) with three children: the job's registered script process, the job's
    process without the handler, and another job's registered process. The job's registered child writes its stderr to
    a file of its own (`stderr.child`), so the two stacks printed at once cannot interleave; the rest share `stderr`."""
    err = tmp_path / "stderr"
    with open(err, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-c", WORKER, "j1", str(tmp_path / "stderr.child")], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=sink,
                                text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))  # fmt: skip
    assert proc.stdout is not None
    kids = [int(pid) for pid in proc.stdout.readline().split()]
    try:
        wait_for(lambda: all(catches(p) for p in (proc.pid, kids[0], kids[2])), timeout=30, what="handlers")
        yield proc, kids, err
    finally:
        for pid in (*kids, proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=10)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_the_worker_and_its_jobs_registered_child_print_their_stacks_and_live_on(worker) -> None:
    proc, (mine, unregistered, others), err = worker
    assert not catches(unregistered)
    assert children_of(proc.pid, "j1") == sorted([mine, unregistered])  # the other job's child is not the job's
    lines = signal_ranks([proc.pid], "j1")
    assert f"pid {proc.pid} (train worker): stack asked for" in lines
    assert f"pid {mine} (child of {proc.pid}): stack asked for" in lines
    assert f"pid {unregistered} (child of {proc.pid}): left alone, it does not catch SIGUSR1" in lines
    child_err = err.with_name("stderr.child")
    for where, frame in ((err, "worker_waits_here"), (child_err, "child_waits_here")):
        # faulthandler writes a dump in many small writes: wait for the frame's own line, not the dump's first one
        # (CI once read "Current thread ...\n  File \"<string>\"" with the rest still on its way).
        text = wait_for(lambda w=where, f=frame: f in (t := w.read_text()) and t, timeout=10, what=f"{frame}'s stack")
        assert "Current thread" in str(text) and 'File "<string>", line ' in str(text), (where.name, text)
    time.sleep(0.5)
    assert all(alive(pid) for pid in (proc.pid, mine, unregistered, others))  # nobody was killed by it


def test_a_process_that_never_registered_is_left_alone(tmp_path: Path) -> None:
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        time.sleep(0.5)
        assert not catches(plain.pid)
        assert signal_ranks([plain.pid], "j1") == [f"pid {plain.pid} (train worker): left alone, it does not catch "
                                                   "SIGUSR1"]  # fmt: skip
        time.sleep(0.3)
        assert plain.poll() is None
    finally:
        plain.kill()
        plain.wait(timeout=10)
    assert not catches(plain.pid)  # gone: nothing to read, nothing to signal


def test_a_script_process_registers_through_shunters_site_hook(tmp_path: Path) -> None:
    """Script mode: the unchanged script registers nothing itself; shunter's sitecustomize (first on its PYTHONPATH,
    with SHUNTER_SCRIPT_CONTROL set, as workers.script starts it) does, and the dump reaches its stderr."""
    from workers.script_progress import SITE_DIR

    script = tmp_path / "train.py"
    script.write_text("import time\n\ndef script_waits_here():\n    time.sleep(600)\n\nscript_waits_here()\n")
    env = dict(os.environ, PYTHONPATH=str(SITE_DIR), SHUNTER_SCRIPT_CONTROL=str(tmp_path), SHUNTER_JOB_ID="j1")
    err = tmp_path / "stderr"
    with open(err, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-u", str(script)], env=env, stderr=sink)
    try:
        wait_for(lambda: catches(proc.pid), timeout=30, what="the site hook's handler")
        os.kill(proc.pid, signal.SIGUSR1)
        wait_for(lambda: "script_waits_here" in err.read_text(), timeout=10, what="the script's stack")
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait(timeout=10)
    plain = subprocess.Popen([sys.executable, str(script)], env=dict(env, SHUNTER_SCRIPT_CONTROL=""))
    try:
        time.sleep(1.0)
        assert not catches(plain.pid)  # outside a shunter script run the hook registers nothing
    finally:
        plain.kill()
        plain.wait(timeout=10)
