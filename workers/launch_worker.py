"""Ray's worker set-up step without importing Ray: the first process of every Ray worker on a head that shunter starts.

A raylet starts each worker process (every actor: a job's supervisor, Ray Train's controller, its workers) as
`python ray/_private/workers/setup_worker.py <worker args>`. That script imports Ray (about 0.5 CPU-seconds on this
project's 2-core machine), applies the runtime environment's context (environment variables, a command prefix,
another interpreter), and replaces itself with `bash -c "exec python default_worker.py ..."`, which imports Ray again.
The first import is spent on reading a JSON string: on the slow test tier's ~500 worker processes it was ~4 minutes of
one core.

This script does the same step with the standard library alone, for the one case it knows: a Python worker on Linux
whose context has only the fields Ray 2.60's `RuntimeEnvContext` has. Anything else (another language, Java jars, a
field a later Ray adds) is handed to Ray's own `setup_worker.py` with the same arguments, so it runs as Ray runs it.
`tests/workers/test_launch_worker.py` checks, case by case, that the command and environment built here are the ones
Ray's `RuntimeEnvContext.exec_worker` builds, so a Ray upgrade that changes that step fails there first.

`service.backends.ray_start` (what `service.backends.ray_local` runs in place of `ray start`) points a node's raylet
here. A cluster started with Ray's own `ray start` is not affected.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
from collections.abc import Mapping

# RuntimeEnvContext's fields in Ray 2.60 (`ray/_private/runtime_env/context.py`).
KNOWN_FIELDS = frozenset({"command_prefix", "env_vars", "py_executable", "override_worker_entrypoint", "java_jars"})
_UNSET = re.compile(r"\$\{[A-Z0-9_]+\}")


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """setup_worker.py's own arguments, and the rest (the worker's command line) as it leaves them."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--serialized-runtime-env-context", type=str)
    parser.add_argument("--language", type=str)
    return parser.parse_known_args(argv)


def update_envs(env_vars: Mapping[str, str]) -> None:
    """`ray._private.utils.update_envs`, on this process's environment: each value with `$X`/`${X}` expanded from the
    environment as updated so far, and a `${X}` of a variable that is not set made empty."""
    for key, value in env_vars.items():
        os.environ[key] = _UNSET.sub("", os.path.expandvars(value))


def worker_command(serialized_context: str | None, language: str | None, passthrough: list[str]) -> list[str] | None:
    """The argv that replaces this process (`bash -c "exec python <worker>"`, as Ray's), with this process's
    environment updated as Ray updates it; None (and the environment untouched) where the case is Ray's own."""
    if language != "PYTHON" or not sys.platform.startswith("linux"):
        return None
    try:
        context = json.loads(serialized_context or "{}")
    except ValueError:
        return None
    if not isinstance(context, dict) or set(context) - KNOWN_FIELDS or context.get("java_jars"):
        return None
    update_envs(context.get("env_vars") or {})
    args = list(passthrough)
    if context.get("override_worker_entrypoint"):
        args[0] = context["override_worker_entrypoint"]
    command = [*(context.get("command_prefix") or []), "exec", context.get("py_executable") or sys.executable]
    command += [shlex.quote(arg) for arg in args]
    return ["bash", "-c", " ".join(command)]


def ray_setup_worker() -> str:
    """Ray's own setup_worker.py, found without importing Ray."""
    import importlib.util

    spec = importlib.util.find_spec("ray")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("launch_worker: Ray is not installed for this interpreter")
    return os.path.join(list(spec.submodule_search_locations)[0], "_private", "workers", "setup_worker.py")


def main(argv: list[str]) -> None:
    args, passthrough = parse(argv)
    command = worker_command(args.serialized_runtime_env_context, args.language, passthrough)
    if command is None:
        os.execv(sys.executable, [sys.executable, ray_setup_worker(), *argv])
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
