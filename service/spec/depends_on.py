"""What a job spec may say about the jobs it waits for (`depends_on`), and the `${deps.<as>.<what>}` references in its
config that are filled in with a dependency's results when the job starts. Pure: no database, no torch (workers
import the spec).

A reference is the whole of, or a part of, a config string value, at any depth of `config`:
`"${deps.pre.checkpoint}"` (the dependency's latest complete checkpoint when it met its condition) or
`"${deps.pre.model}"` (its final output: the kept outputs folder of a script-mode job, else that checkpoint).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from enum import Enum
from typing import Any

from pydantic import ConfigDict, Field, field_validator

from service.core.numbers import StrictModel

MAX_DEPENDENCIES = 64
ALIAS_PATTERN = r"[A-Za-z_][A-Za-z0-9_]{0,63}"
_ALIAS = re.compile(ALIAS_PATTERN)
# A job id as the API takes one in a path (`api.routes.jobs.JobId`): ours are "j" + hex.
_JOB_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
# Anything that starts like a reference is read as one: a misspelt one must be an error, not a literal string.
REFERENCE = re.compile(r"\$\{deps\.([^}]*)\}")
_INNER = re.compile(rf"({ALIAS_PATTERN})\.(checkpoint|model)")
KINDS = ("checkpoint", "model")


class Condition(str, Enum):
    """When a dependency is met: it succeeded, or it ended in any way (SUCCEEDED, FAILED or CANCELLED)."""

    succeeded = "succeeded"
    ended = "ended"


class OnFailure(str, Enum):
    """What a job does when a dependency can no longer meet its condition: end FAILED, or end CANCELLED."""

    fail = "fail"
    cancel = "cancel"


class Dependency(StrictModel):
    """One job this job waits for."""

    # `as` is a Python keyword: the field is `as_`, read and written as "as" only.
    model_config = ConfigDict(
        extra="forbid", validate_by_name=False, validate_by_alias=True, serialize_by_alias=True, allow_inf_nan=False
    )

    job: str = Field(description="the id of the job to wait for")
    on: Condition = Field(Condition.succeeded, description="succeeded: it must succeed; ended: it must end")
    as_: str | None = Field(
        None, alias="as", description="a name for it in `${deps.<as>.checkpoint}` / `${deps.<as>.model}` references"
    )

    @field_validator("job")
    @classmethod
    def _job_form(cls, value: str) -> str:
        if not _JOB_ID.fullmatch(value):
            raise ValueError("a job id: 1-64 letters, digits, '_' or '-'")
        return value

    @field_validator("as_")
    @classmethod
    def _alias_form(cls, value: str | None) -> str | None:
        if value is not None and not _ALIAS.fullmatch(value):
            raise ValueError("a name of 1-64 letters, digits or '_', not starting with a digit")
        return value


def dependency_problem(deps: list[Dependency]) -> tuple[tuple[str | int, ...], str] | None:
    """(where, what) of the first repeated job or name among `deps`, or None."""
    jobs: dict[str, int] = {}
    names: dict[str, int] = {}
    for i, dep in enumerate(deps):
        if dep.job in jobs:
            return (i, "job"), f"job {dep.job} is already depends_on[{jobs[dep.job]}]"
        jobs[dep.job] = i
        if dep.as_ is not None:
            if dep.as_ in names:
                return (i, "as"), f"name {dep.as_!r} is already depends_on[{names[dep.as_]}]'s"
            names[dep.as_] = i
    return None


def _strings(value: Any, path: str) -> Iterator[tuple[str, str]]:
    """(path, string) of every string value below `value` (a loop, not recursion: configs may nest deeply)."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            yield where, item
        elif isinstance(item, dict):
            stack.extend((v, f"{where}.{k}") for k, v in item.items())
        elif isinstance(item, list | tuple):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(item))


def references(config: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Every `${deps.<as>.<kind>}` in `config`'s strings as (path, alias, kind), in path order; a malformed one
    raises ValueError naming its path."""
    found = []
    for path, text in _strings(config, "config"):
        for match in REFERENCE.finditer(text):
            inner = _INNER.fullmatch(match.group(1))
            if inner is None:
                shown = match.group(0)[:80]
                raise ValueError(f"{path}: {shown!r} is no reference; use ${{deps.<as>.checkpoint}} or .model")
            found.append((path, inner.group(1), inner.group(2)))
    return sorted(found)


def reference_problem(config: dict[str, Any], deps: list[Dependency]) -> tuple[str, str] | None:
    """(path, what) of the first reference in `config` that is malformed or names no `depends_on[].as`, or None."""
    try:
        found = references(config)
    except ValueError as exc:
        path, _, what = str(exc).partition(": ")
        return path, what
    names = {d.as_ for d in deps if d.as_ is not None}
    for path, alias, _ in found:
        if alias not in names:
            known = ", ".join(sorted(names)) or "none"
            return path, f"${{deps.{alias}...}} names no depends_on entry with as: {alias!r} (names: {known})"
    return None


Lookup = Callable[[str, str], "str | None"]


def substitute(config: dict[str, Any], lookup: Lookup) -> tuple[dict[str, Any], list[str]]:
    """`config` with every reference replaced by `lookup(alias, kind)`; and the paths whose reference `lookup`
    could not resolve (None), which are left as written."""
    missing: list[str] = []

    def fill(value: Any, path: str) -> Any:
        if isinstance(value, str):
            if "${deps." not in value:
                return value

            def one(match: re.Match[str]) -> str:
                inner = _INNER.fullmatch(match.group(1))
                got = lookup(inner.group(1), inner.group(2)) if inner else None
                if got is None:
                    missing.append(f"{path}: {match.group(0)}")
                    return match.group(0)
                return got

            return REFERENCE.sub(one, value)
        if isinstance(value, dict):
            return {k: fill(v, f"{path}.{k}") for k, v in value.items()}
        if isinstance(value, list):
            return [fill(v, f"{path}[{i}]") for i, v in enumerate(value)]
        return value

    return fill(config, "config"), missing
