"""Changes to a job spec given on the command line: `--env KEY=VAL` (into `runtime_env.env_vars`) and
`--set a.b=value` (any field, by its dotted path; the value read as YAML, so `--set resources.num_workers=4` is a
number and `--set resources.use_gpu=true` a boolean). Applied to the file's spec before it is sent; the service
checks the result as it checks any spec."""

from __future__ import annotations

import re
from typing import Any

import yaml

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
PATH_PART = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class OverrideError(ValueError):
    pass


def apply(spec: dict[str, Any], *, env: list[str] | None = None, sets: list[str] | None = None) -> dict[str, Any]:
    """`spec` with the overrides applied (a new dict; the argument is not changed)."""
    out = yaml.safe_load(yaml.safe_dump(spec))  # a deep copy of plain data
    for item in sets or ():
        path, sep, raw = item.partition("=")
        parts = path.split(".")
        if not sep or not all(PATH_PART.fullmatch(p) for p in parts):
            raise OverrideError(f"--set {item!r}: expected a.b.c=value (field names joined by dots)")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise OverrideError(f"--set {item!r}: the value is not YAML ({exc})") from exc
        here = out
        for i, part in enumerate(parts[:-1]):
            nxt = here.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise OverrideError(f"--set {item!r}: {'.'.join(parts[: i + 1])} is not a mapping")
            here = nxt
        here[parts[-1]] = value
    for item in env or ():
        name, sep, value = item.partition("=")
        if not sep or not ENV_NAME.fullmatch(name):
            raise OverrideError(f"--env {item!r}: expected NAME=value, NAME a variable name")
        runtime_env = out.setdefault("runtime_env", {})
        if not isinstance(runtime_env, dict):
            raise OverrideError("--env: runtime_env is not a mapping")
        env_vars = runtime_env.setdefault("env_vars", {})
        if not isinstance(env_vars, dict):
            raise OverrideError("--env: runtime_env.env_vars is not a mapping")
        env_vars[name] = value
    return out
