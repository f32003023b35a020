"""`workers/launch_worker.py` does Ray's worker set-up step as Ray does it: for every context here the command and the
environment it builds are those of Ray's own `RuntimeEnvContext.exec_worker` (its exec caught, nothing else), what
it does not know is handed to Ray's `setup_worker.py`, and run as a process it really becomes the worker command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.backends.ray_start import LAUNCHER
from workers import launch_worker

WORKER = ["/ray/_private/workers/default_worker.py", "--node-ip-address=127.0.0.1", "--arg=with space", "it's"]
CONTEXTS = {
    "empty": {},
    "env_vars": {"env_vars": {"A": "1", "B": "x${SHUNTER_T_SET}y", "C": "${SHUNTER_T_UNSET}z", "D": "${A}-$A"}},
    "prefix": {"command_prefix": ["cd", "/tmp", "&&"], "env_vars": {"PYTHONPATH": "/w:${PYTHONPATH}"}},
    "interpreter": {"py_executable": "/opt/py/bin/python3 -X importtime"},
    "entrypoint": {"override_worker_entrypoint": "/container/default_worker.py"},
    "every field": {"command_prefix": ["source", "/env/activate", "&&"], "env_vars": {"K": "v"},
                    "py_executable": "/x/python", "override_worker_entrypoint": "/y/w.py", "java_jars": []},
}  # fmt: skip


def rays_exec(context: dict, passthrough: list[str], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    from ray._private.runtime_env import context as ray_context
    from ray.core.generated.common_pb2 import Language

    caught: list[list[str]] = []
    monkeypatch.setattr(ray_context.os, "execvp", lambda file, args: caught.append(args))
    ray_context.RuntimeEnvContext.deserialize(json.dumps(context)).exec_worker(list(passthrough), Language.PYTHON)
    assert len(caught) == 1
    return caught[0]


@pytest.mark.parametrize("name", list(CONTEXTS))
def test_the_command_and_environment_are_rays(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import ray._private.runtime_env.context  # noqa: F401  (importing Ray sets RAY_CLIENT_MODE: before the snapshot)

    monkeypatch.setenv("SHUNTER_T_SET", "set")
    monkeypatch.delenv("SHUNTER_T_UNSET", raising=False)
    monkeypatch.setenv("PYTHONPATH", "/before")
    before = dict(os.environ)
    ours = launch_worker.worker_command(json.dumps(CONTEXTS[name]), "PYTHON", list(WORKER))
    our_env = dict(os.environ)
    os.environ.clear()
    os.environ.update(before)
    theirs = rays_exec(CONTEXTS[name], WORKER, monkeypatch)
    assert ours == theirs
    assert our_env == dict(os.environ)
    if name == "env_vars":
        assert (our_env["B"], our_env["C"], our_env["D"]) == ("xsety", "z", "1-1")


def test_arguments_are_split_as_setup_worker_splits_them() -> None:
    argv = ["--serialized-runtime-env-context={}", *WORKER[:2], "--language=PYTHON", *WORKER[2:]]
    args, rest = launch_worker.parse(argv)
    assert (args.serialized_runtime_env_context, args.language, rest) == ("{}", "PYTHON", WORKER)


@pytest.mark.parametrize(
    ("context", "language"),
    [("{}", "JAVA"), ("{}", "CPP"), ("{}", None), ('{"java_jars": ["/a.jar"]}', "PYTHON"),
     ('{"a_later_field": 1}', "PYTHON"), ("not json", "PYTHON"), ("[]", "PYTHON")],
)  # fmt: skip
def test_what_it_does_not_know_is_rays_own(context: str, language: str | None) -> None:
    before = dict(os.environ)
    assert launch_worker.worker_command(context, language, list(WORKER)) is None
    assert dict(os.environ) == before


def test_run_as_a_process_it_becomes_the_worker_command(tmp_path: Path) -> None:
    probe = "import os, sys; print(os.environ['SHUNTER_T'], os.getcwd(), sys.argv[1:])"
    context = {"env_vars": {"SHUNTER_T": "${HOME}!"}, "command_prefix": ["cd", str(tmp_path), "&&"]}
    done = subprocess.run(
        [sys.executable, LAUNCHER, f"--serialized-runtime-env-context={json.dumps(context)}", "-c", probe,
         "--language=PYTHON", "a b"], capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert done.stdout.split("\n")[0] == f"{os.environ['HOME']}! {tmp_path} ['a b']"


def test_a_context_it_does_not_know_reaches_rays_setup_worker() -> None:
    # Ray's own step, given a field it does not have either, fails in RuntimeEnvContext: proof it was Ray's that ran.
    done = subprocess.run(
        [sys.executable, LAUNCHER, '--serialized-runtime-env-context={"a_later_field": 1}', "-c", "print('ran')",
         "--language=PYTHON"], capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode != 0 and "ran" not in done.stdout
    assert "RuntimeEnvContext" in done.stderr and "a_later_field" in done.stderr, done.stderr[-2000:]
