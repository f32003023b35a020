"""What `POST /v1/sweeps` takes, and how it expands into member job specs (pure: no database, no settings).

Members, in index order:
- `grid` is a cartesian product over its keys, in the order given, the last key varying fastest;
- `points` are explicit assignments; with a grid, every grid combination is crossed with every point
  (grid-major: member order is grid combination, then point);
- `count` repeats each of those (or, alone, the base spec) `count` times, repetitions adjacent; with `count` every
  member's `config.sweep_index` is its index, so the members of an array tell themselves apart.

A key is a dotted path: from a field of the spec when it starts with one (`queue`, `resources.num_workers`,
`config.lr`), else into `config` (`lr`, `optim.lr` are config.lr, config.optim.lr; a config key named like a spec
field is written `config.<key>`); `name` is the sweep's to set (`<sweep name>-<index>`). Each member is then
validated as any job spec is, and the first that is not names its member, its values and the key that set the bad
value.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import re
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from service.core.errors import InvalidSpec
from service.core.numbers import StrictModel
from service.spec.job import JobSpec, field_error
from service.spec.strategy import check_finite

# The member's name is "<sweep name>-<index>" and a job's name has at most 128 characters.
_SWEEP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,119}")
_METRIC_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_./:-]{0,127}")
INDEX_KEY = "sweep_index"  # the config key `count` fills in
MAX_COUNT = 100_000  # a static bound; the service's own cap is `Settings.max_sweep_members`
SPEC_ROOTS = frozenset(JobSpec.model_fields) - {"name"}
NOT_SWEPT = frozenset({"notify"})


class SweepMetric(StrictModel):
    """The metric members are ranked by: the last value each reported of it (`GET /v1/sweeps/{id}`)."""

    name: str = Field(description="a metric the train loop reports, e.g. loss")
    mode: Literal["min", "max"] = Field("min", description="min: lower is better; max: higher is better")

    @field_validator("name")
    @classmethod
    def _name_form(cls, value: str) -> str:
        if not _METRIC_NAME.fullmatch(value):
            raise ValueError("use 1-128 letters, digits or '_./:-', as a reported metric's name")
        return value


class SweepRequest(StrictModel):
    """A sweep or an array: a base job spec and the values its members fill in."""

    name: str = Field("sweep", description="members are named <name>-<index>")
    base: JobSpec
    grid: dict[str, list[Any]] | None = Field(None, description="key -> the values to try; the cartesian product")
    points: list[dict[str, Any]] | None = Field(None, description="explicit assignments, crossed with the grid")
    count: int | None = Field(None, ge=1, le=MAX_COUNT, description="repetitions; each member gets config.sweep_index")
    max_parallel: int | None = Field(None, ge=1, le=10_000, description="members active at once, at most")
    metric: SweepMetric | None = None

    @field_validator("name")
    @classmethod
    def _name_form(cls, value: str) -> str:
        if not _SWEEP_NAME.fullmatch(value):
            raise ValueError("use 1-120 letters, digits, '.', '_' or '-', starting with a letter or digit")
        return value

    @model_validator(mode="after")
    def _values(self) -> SweepRequest:
        if "name" not in self.model_fields_set and "name" in self.base.model_fields_set:
            if not _SWEEP_NAME.fullmatch(self.base.name):
                raise field_error(("name",), "base.name is over 120 characters: give the sweep a name", None,
                                  "SweepRequest")  # fmt: skip
            self.name = self.base.name  # members of a sweep of "mlp" are mlp-0, mlp-1, ...
        if self.grid is None and self.points is None and self.count is None:
            raise field_error(("grid",), "give grid, points or count (or several)", None, "SweepRequest")
        if self.grid is not None:
            if not self.grid:
                raise field_error(("grid",), "give at least one key", self.grid, "SweepRequest")
            for key, values in self.grid.items():
                _check_key(key, ("grid", key))
                if not values:
                    raise field_error(("grid", key), "give at least one value", values, "SweepRequest")
                _finite(values, ("grid", key))
            _check_disjoint(list(self.grid), ("grid",))
        if self.points is not None:
            if not self.points:
                raise field_error(("points",), "give at least one point", self.points, "SweepRequest")
            for j, point in enumerate(self.points):
                for key in point:
                    _check_key(key, ("points", j, key))
                _finite(point, ("points", j))
                _check_disjoint([*(self.grid or {}), *point], ("points", j))
        if self.count is not None:
            for key in [*(self.grid or {}), *(k for p in self.points or [] for k in p)]:
                if _overlaps(path_of(key), ("config", INDEX_KEY)):
                    loc = ("grid", key) if key in (self.grid or {}) else ("points",)
                    raise field_error(loc, f"config.{INDEX_KEY} is set by count", key, "SweepRequest")
        return self

    @property
    def size(self) -> int:
        """How many members this makes (computed, never expanded: a grid may multiply to far too many)."""
        combos = math.prod(len(v) for v in (self.grid or {}).values())
        return combos * len(self.points or [{}]) * (self.count or 1)

    def assignments(self) -> Iterator[dict[str, Any]]:
        """Each member's filled values (key as given -> value), in index order; `count` adds its sweep_index."""
        keys = list(self.grid or {})
        combos = itertools.product(*(self.grid or {}).values())
        index = 0
        for combo in combos:
            for point in self.points or [{}]:
                for _ in range(self.count or 1):
                    values = {**dict(zip(keys, combo, strict=True)), **point}
                    if self.count is not None:
                        values[f"config.{INDEX_KEY}"] = index
                    yield copy.deepcopy(values)
                    index += 1


def path_of(key: str) -> tuple[str, ...]:
    """A grid or point key as a path into the spec: from a spec field when it starts with one (`queue`,
    `resources.num_workers`, `config.lr`), else into config (`lr`, `optim.lr`)."""
    parts = tuple(key.split("."))
    return parts if parts[0] in SPEC_ROOTS or parts[0] == "name" else ("config", *parts)


def _check_key(key: str, loc: tuple[str | int, ...]) -> None:
    parts = path_of(key)
    if any(not p for p in parts):
        raise field_error(loc, f"{key!r} has an empty part", key, "SweepRequest")
    if parts[0] == "name":
        raise field_error(loc, "the sweep names its members (<sweep name>-<index>)", key, "SweepRequest")
    if parts[0] in NOT_SWEPT:
        # Its secrets are write-only: swept values are stored and shown as given, so one would be returned.
        raise field_error(loc, f"{parts[0]} is not swept; set it in base", key, "SweepRequest")


def _overlaps(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    return a[: len(b)] == b or b[: len(a)] == a


def _check_disjoint(keys: list[str], loc: tuple[str | int, ...]) -> None:
    """No two keys of one member may set the same value, or one inside the other (which would win is arbitrary)."""
    for a, b in itertools.combinations(keys, 2):
        if _overlaps(path_of(a), path_of(b)):
            raise field_error((*loc, b), f"{b!r} sets what {a!r} also sets", b, "SweepRequest")


def _finite(value: Any, loc: tuple[str | int, ...]) -> None:
    try:
        check_finite(value, ".".join(str(p) for p in loc))
    except ValueError as exc:
        raise field_error(loc, str(exc).split(": ", 1)[-1], None, "SweepRequest") from None


def apply(spec: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """`spec` (a JSON dump) with `values` set at their paths; a missing mapping on the way is made, anything else
    on the way is an InvalidSpec naming the key."""
    out = copy.deepcopy(spec)
    for key, value in values.items():
        parts = path_of(key)
        here = out
        for depth, part in enumerate(parts[:-1]):
            nxt = here.setdefault(part, {})
            if not isinstance(nxt, dict):
                where = ".".join(parts[: depth + 1])
                raise InvalidSpec(f"{key}: {where} is not a mapping in the base spec", field=key)
            here = nxt
        here[parts[-1]] = value
    return out


def member_specs(request: SweepRequest) -> list[tuple[dict[str, Any], JobSpec]]:
    """(values, spec) of every member, in index order; InvalidSpec names the member and the key at fault."""
    base = request.base.model_dump(mode="json", exclude_unset=True)
    out = []
    for index, values in enumerate(request.assignments()):
        try:
            body = apply(base, values)
        except InvalidSpec as exc:
            where = _source(request, exc.field or "")
            raise InvalidSpec(f"member {index} {_shown(values)}: {exc.detail}", field=where) from None
        body["name"] = f"{request.name}-{index}"
        try:
            member = JobSpec.model_validate(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            loc = ".".join(str(p) for p in first["loc"] if not isinstance(p, int))
            message = str(first["msg"]).removeprefix("Value error, ")
            key = next((k for k in values if _overlaps(path_of(k), tuple(loc.split(".")))), None)
            field = _source(request, key) if key else f"base.{loc}"
            raise InvalidSpec(f"member {index} {_shown(values)}: {loc}: {message}", field=field) from None
        _carry_write_only(request.base, member)
        out.append((values, member))
    return out


def _carry_write_only(base: JobSpec, member: JobSpec) -> None:
    """A notify entry's secret is write-only, left out of every dump: a member whose entry is the base's, unchanged,
    is signed with the base's secret too (not with the cluster's)."""
    for mine, given in zip(getattr(member, "notify", None) or [], getattr(base, "notify", None) or [], strict=False):
        if mine.secret is None and given.secret is not None and mine.model_dump() == given.model_dump():
            mine.secret = given.secret


def _source(request: SweepRequest, key: str) -> str:
    """The request field a member's value came from."""
    if key == f"config.{INDEX_KEY}" and request.count is not None:
        return "count"
    return f"grid.{key}" if key in (request.grid or {}) else f"points.{key}"


def _shown(values: dict[str, Any]) -> str:
    text = json.dumps(values, sort_keys=False)
    return text if len(text) <= 200 else text[:197] + "..."
