"""The names a spec's `secrets:` may hold (issue 38; the values are `service.tenancy.secret_store`'s).

A secret reaches the job as an environment variable of exactly its name, so a name is one: capitals, digits and
'_', not starting with a digit. Names starting with `SHUNTER_` or `RAY_` are refused: those variables are shunter's
and Ray's, and how the driver runs depends on them. A spec names a secret once, and does not also set it in
`runtime_env.env_vars` (which would show its value in the Ray dashboard, and leave which one wins unclear).
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator

NAME = re.compile(r"[A-Z_][A-Z0-9_]{0,127}")
RESERVED_PREFIXES = ("SHUNTER_", "RAY_")
MAX_SECRETS = 64
MAX_VALUE_CHARS = 65536  # a secret's value: a token, a key, a small credentials file
NAME_PATTERN = r"^[A-Z_][A-Z0-9_]{0,127}$"


def name_problem(name: object) -> str | None:
    """Why `name` cannot be a secret's name, or None."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        return "a secret's name is an environment variable's: capitals, digits and '_', not starting with a digit"
    if name.startswith(RESERVED_PREFIXES):
        return f"names starting with {' or '.join(RESERVED_PREFIXES)} are shunter's and Ray's"
    return None


def _checked(name: str) -> str:
    problem = name_problem(name)
    if problem:
        raise ValueError(problem)
    return name


SecretName = Annotated[str, AfterValidator(_checked)]


def conflict(names: list[str], runtime_env: dict[str, Any]) -> tuple[tuple[str | int, ...], str] | None:
    """(where, why) for a name given twice, or also set in `runtime_env.env_vars`; None when there is none."""
    env_vars = runtime_env.get("env_vars") or {}
    for i, name in enumerate(names):
        if name in names[:i]:
            return ("secrets", i), f"{name} is named twice"
        if name in env_vars:
            return ("secrets", i), f"{name} is also set in runtime_env.env_vars: a secret's value goes in the secret"
    return None
