"""The job spec: one pydantic model, the single source of truth for what a user may ask.

Everything a user can get wrong is caught here, at submission, with the offending field named; checks that need
the cluster (GPUs present, fits at all) live in `service.lifecycle.jobs`. Workers import this module too, so it stays
free of torch and of the database.
"""

from __future__ import annotations

import math
import re
from enum import Enum
from typing import Any

from pydantic import (
    BaseModel,
    Field,
    StrictBool,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from service.core import resources
from service.core.numbers import INT32_MAX, StrictModel
from service.spec.depends_on import (
    MAX_DEPENDENCIES,
    Dependency,
    OnFailure,
    dependency_problem,
    reference_problem,
)
from service.spec.entrypoint import Entrypoint
from service.spec.notify import MAX_TARGETS, NotifyTarget
from service.spec.secret_names import MAX_SECRETS, SecretName, conflict
from service.spec.strategy import StrategySpec, check_finite

# Matched with fullmatch: `$` would also accept a trailing newline.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
QUEUE_PATTERN = r"[a-z0-9][a-z0-9_-]{0,63}"
QUEUE_NAME = re.compile(QUEUE_PATTERN)
PRIORITY_MIN, PRIORITY_MAX = -1000, 1000
# Ray counts resources in steps of 0.0001: a smaller CPU or GPU amount is a worker that holds nothing, which would
# escape both Ray's admission and a queue's max_cpus / max_gpus.
MIN_AMOUNT = 0.0001
# How deep a spec (the request body is level 1) may nest: `Settings.max_spec_depth` at submission, and never more
# than this (pydantic cannot serialise a value nested much deeper than 250 levels).
MAX_SPEC_DEPTH = 200
_MEMORY = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*", re.IGNORECASE | re.ASCII)
# A checkpoint id: a positive integer that fits a 64-bit database column (ASCII digits only; "²".isdigit() is true).
_CHECKPOINT_ID = re.compile(r"[1-9][0-9]{0,17}")
# Row ids are 32-bit on PostgreSQL: a larger id named no row, and failed every dispatcher tick with a raw SQL error
# (NumericValueOutOfRange) before it was refused here (issue 35).
MAX_ROW_ID = INT32_MAX
_MEMORY_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "ki": 1024, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mi": 1024**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gi": 1024**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "ti": 1024**4, "tib": 1024**4,
}  # fmt: skip
# Ray runtime_env keys shunter passes through untouched; anything else is a typo worth a 422.
RUNTIME_ENV_KEYS = frozenset(
    {"working_dir", "py_modules", "pip", "uv", "conda", "env_vars", "excludes", "config", "image_uri", "container"}
)


def field_error(loc: tuple[str | int, ...], message: str, value: Any, title: str = "JobSpec") -> ValidationError:
    """A validation error at `loc` below the field being validated (a validator that raises it names a key the
    plain ValueError could not, e.g. resources.resources_per_worker.CPU)."""
    error = PydanticCustomError("value_error", "{reason}", {"reason": message})
    return ValidationError.from_exception_data(title, [{"type": error, "loc": loc, "input": value}])


def _too_deep(value: Any, limit: int, where: str) -> str | None:
    """The path of the first object or array of `value` nested deeper than `limit` levels (`value` itself is level 1),
    or None. A loop, not recursion: the input may be nested thousands of levels deep."""
    stack = [(value, where, 1)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, BaseModel):
            children = [(getattr(item, k), f"{path}.{k}".lstrip(".")) for k in type(item).model_fields]
        elif isinstance(item, dict):
            children = [(v, f"{path}.{k}") for k, v in item.items()]
        elif isinstance(item, list | tuple):
            children = [(v, f"{path}[{i}]") for i, v in enumerate(item)]
        else:
            continue
        if depth > limit:
            return path
        stack.extend((child, child_path, depth + 1) for child, child_path in children)
    return None


def parse_memory(value: str | int | float) -> int:
    """'64GiB' -> bytes. Plain numbers are bytes, as Ray counts memory."""
    if isinstance(value, bool):
        raise ValueError(f"memory must be a number of bytes or a size like 64GiB, got {value!r}")
    if isinstance(value, int | float):
        if not _fits_float(value):
            raise ValueError(f"memory must be a finite number of bytes, got {_shown(value)}")
        if value < 0:
            raise ValueError("memory must not be negative")
        return int(value)
    match = _MEMORY.fullmatch(value)
    if not match:
        raise ValueError(f"cannot read memory size {value!r}; use e.g. 512MiB, 64GiB or a number of bytes")
    number, unit = match.groups()
    size = float(number) * _MEMORY_UNITS[(unit or "").lower()]
    if not math.isfinite(size):
        raise ValueError(f"memory size {value!r} is too large")
    return int(size)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _fits_float(value: int | float) -> bool:
    """A finite number that also fits a float (a 400-digit integer does not: float() of it is an OverflowError)."""
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _amount_problem(key: str, amount: Any, use_gpu: bool | None) -> str | None:
    """What is wrong with one `resources_per_worker` amount, or None."""
    if key == "memory":
        try:
            parse_memory(amount)
        except (TypeError, ValueError) as exc:
            return str(exc)
        return None
    if isinstance(amount, bool) or not isinstance(amount, int | float):
        return f"must be a number, got {_shown(amount)}"
    if not _fits_float(amount):
        return f"must be a finite number, got {_shown(amount)}"
    if amount < 0:
        return f"must not be negative, got {_shown(amount)}"
    if key == "CPU" and amount < MIN_AMOUNT:
        return f"must be at least {MIN_AMOUNT}: a worker holding no CPU escapes admission and max_cpus (got {amount})"
    if key == "GPU" and use_gpu is False and amount > 0:
        return "is set but use_gpu is false; set resources.use_gpu: true"
    if key == "GPU" and use_gpu and amount < MIN_AMOUNT:
        return f"must be at least {MIN_AMOUNT} with use_gpu: true; leave it out for 1 GPU per worker (got {amount})"
    return None


class Placement(str, Enum):
    pack = "pack"
    spread = "spread"
    strict_pack = "strict_pack"
    strict_spread = "strict_spread"

    @property
    def ray_strategy(self) -> str:
        return self.value.upper()


MAX_WORKERS = 4096
# An accelerator type as Ray names it (`ray.util.accelerators`: "H100", "A10G", "TPU-V5P"); a node of that type
# carries the resource `accelerator_type:<name>` (1), and a worker asks for a sliver of it, as Ray Train's
# `ScalingConfig(accelerator_type=...)` does.
ACCELERATOR_TYPE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
ACCELERATOR_SHARE = 0.001


class WorkerRange(StrictModel):
    """An elastic worker group: admitted at the most workers in [min, max] that fit (gang semantics hold for min)."""

    min: int = Field(ge=1, le=MAX_WORKERS)
    max: int = Field(ge=1, le=MAX_WORKERS)

    @model_validator(mode="after")
    def _ordered(self) -> WorkerRange:
        if self.max < self.min:
            raise field_error(("max",), f"must be at least min ({self.min})", self.max, "WorkerRange")
        return self


class Resources(StrictModel):
    num_workers: int | WorkerRange = Field(1, description='workers, or {"min": m, "max": n} for an elastic group')
    use_gpu: StrictBool = False
    resources_per_worker: dict[str, float | int | str] = Field(default_factory=dict)
    placement: Placement = Placement.pack
    accelerator_type: str | None = Field(
        None, description='the accelerator type every worker runs on ("H100", "A10G"; a CPU node type may carry one '
        "too); the same as the raw resource accelerator_type:<X> in resources_per_worker",
    )  # fmt: skip

    @field_validator("accelerator_type")
    @classmethod
    def _accelerator(cls, value: str | None) -> str | None:
        if value is not None and not ACCELERATOR_TYPE.fullmatch(value):
            raise ValueError("1-64 letters, digits, '_', '.' or '-', starting with a letter or digit (Ray's names)")
        return value

    @field_validator("num_workers", mode="wrap")
    @classmethod
    def _workers(cls, value: Any, handler: Any) -> int | WorkerRange:
        """One error naming the field (not one per member of the union): an integer, or a {min, max} range."""
        if isinstance(value, WorkerRange):
            return value
        if isinstance(value, dict):
            try:
                return WorkerRange.model_validate(value)
            except ValidationError as exc:
                first = exc.errors()[0]
                raise field_error(tuple(first["loc"]), first["msg"], first.get("input"), "Resources") from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError('an integer number of workers, or {"min": m, "max": n} for an elastic group')
        if not 1 <= value <= MAX_WORKERS:
            raise ValueError(f"must be between 1 and {MAX_WORKERS}")
        return value

    @field_validator("resources_per_worker", mode="before")
    @classmethod
    def _amounts(cls, value: Any, info: ValidationInfo) -> Any:
        """Each amount is checked before the type (so a bool is not read as 1, nor 1e999 as three union errors),
        and each error names its key."""
        if not isinstance(value, dict):
            return value  # the type check says what is wrong
        use_gpu = info.data.get("use_gpu")  # absent when use_gpu itself was invalid
        for key, amount in value.items():
            problem = _amount_problem(str(key), amount, use_gpu)
            if problem:
                raise field_error((str(key),), problem, amount, "Resources")
        return value

    def per_worker(self) -> dict[str, float]:
        """The Ray resources one worker holds, with shunter's defaults filled in (1 CPU; 1 GPU if use_gpu)."""
        out: dict[str, float] = {"CPU": 1.0}
        if self.use_gpu:
            out["GPU"] = 1.0
        for key, amount in self.resources_per_worker.items():
            out[key] = float(parse_memory(amount)) if key == "memory" else float(amount)
        if self.accelerator_type is not None:
            key = resources.ACCELERATOR_PREFIX + self.accelerator_type
            out[key] = max(out.get(key, 0.0), ACCELERATOR_SHARE)
        return {k: v for k, v in out.items() if v > 0}

    @property
    def min_workers(self) -> int:
        return self.num_workers.min if isinstance(self.num_workers, WorkerRange) else self.num_workers

    @property
    def max_workers(self) -> int:
        return self.num_workers.max if isinstance(self.num_workers, WorkerRange) else self.num_workers

    @property
    def elastic(self) -> bool:
        return self.min_workers < self.max_workers

    def workers(self, world_size: int | None = None) -> int:
        """`world_size` (the size a job was admitted at) within [min, max]; its max without one."""
        return self.max_workers if world_size is None else min(max(world_size, self.min_workers), self.max_workers)

    def total(self, world_size: int | None = None) -> dict[str, float]:
        """What the whole group holds: at `world_size` workers (see `workers`), default the most it may run."""
        return resources.scaled(self.per_worker(), self.workers(world_size))


class Retries(StrictModel):
    max_worker_failures: int = Field(0, ge=0, le=100, description="worker-group restarts inside one attempt")
    max_attempts: int = Field(1, ge=1, le=100, description="whole runs by shunter, each resuming from a checkpoint")
    backoff_seconds: float = Field(30.0, ge=0, le=86400)
    max_backoff_seconds: float = Field(600.0, ge=0, le=86400)
    retry_on_timeout: StrictBool = Field(False, description="a timed-out attempt is retried only when asked")


class CheckpointSpec(StrictModel):
    storage: str | None = Field(None, description="local path or fsspec/pyarrow URI; default from settings")
    keep: int = Field(3, ge=1, le=1000)
    resume_from: str = Field("latest", description="latest | none | the id of one of the job's checkpoints")

    @field_validator("resume_from")
    @classmethod
    def _resume_form(cls, value: str) -> str:
        if value not in ("latest", "none") and not (_CHECKPOINT_ID.fullmatch(value) and int(value) <= MAX_ROW_ID):
            raise ValueError(
                f"must be 'latest', 'none' or a checkpoint id (a whole number from 1 to {MAX_ROW_ID}, no leading "
                f"zeros), got {value[:40]!r}"
            )
        return value

    @property
    def checkpoint_id(self) -> int | None:
        """The checkpoint `resume_from` names by id; None for latest / none."""
        return int(self.resume_from) if _CHECKPOINT_ID.fullmatch(self.resume_from) else None


class Preflight(StrictModel):
    """The check every worker group runs before the job's own code (`workers.preflight`)."""

    enabled: StrictBool = Field(True, description="run the check before each attempt's training starts")
    slow_factor: float = Field(
        4.0, ge=1.0, le=1000.0,
        description="a rank this many times slower than the median fails the attempt on GPUs (on CPU it warns)",
    )  # fmt: skip
    timeout_seconds: float = Field(60.0, ge=1.0, le=600.0, description="the longest any step of the check may take")


class JobSpec(StrictModel):
    """What a user submits (YAML or JSON)."""

    name: str = Field("job", description="a label; need not be unique")
    queue: str = Field("default", pattern="^" + QUEUE_PATTERN + "$")
    priority: int = Field(0, ge=PRIORITY_MIN, le=PRIORITY_MAX)
    entrypoint: Entrypoint
    config: dict[str, Any] = Field(default_factory=dict, description="handed to the train loop / recipe")
    strategy: StrategySpec = Field(default_factory=StrategySpec)
    resources: Resources = Field(default_factory=Resources)
    retries: Retries = Field(default_factory=Retries)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    runtime_env: dict[str, Any] = Field(default_factory=dict)
    timeout_seconds: float | None = Field(None, gt=0, le=30 * 86400)
    preflight: Preflight = Field(default_factory=Preflight)
    stall_timeout_seconds: float | None = Field(
        None, gt=0, le=7 * 86400,
        description="an attempt that reported progress and then none for this long is stalled (default: from its "
                    "step times)",
    )  # fmt: skip
    depends_on: list[Dependency] = Field(
        default_factory=list, max_length=MAX_DEPENDENCIES,
        description="jobs that must succeed (or end) before this one starts (service.workflows.dependencies)",
    )  # fmt: skip
    on_dependency_failure: OnFailure = Field(
        OnFailure.fail, description="fail: end FAILED (dependency_failed) when a dependency misses; cancel: CANCELLED"
    )
    notify: list[NotifyTarget] = Field(
        default_factory=list, max_length=MAX_TARGETS,
        description="webhooks told of this job's state changes (service.workflows.notifications); each secret is "
        "write-only",
    )  # fmt: skip
    secrets: list[SecretName] = Field([], max_length=MAX_SECRETS, description="kept secrets each rank gets as env vars")

    @field_validator("name")
    @classmethod
    def _name_form(cls, value: str) -> str:
        if not _NAME.fullmatch(value):
            raise ValueError("use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit")
        return value

    @field_validator("config", "runtime_env")
    @classmethod
    def _finite(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        check_finite(value, str(info.field_name))
        return value

    @field_validator("runtime_env")
    @classmethod
    def _runtime_env_keys(cls, value: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(value) - RUNTIME_ENV_KEYS)
        if unknown:
            raise ValueError(f"unknown runtime_env keys {unknown}; known: {sorted(RUNTIME_ENV_KEYS)}")
        env_vars = value.get("env_vars", {})
        if not isinstance(env_vars, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env_vars.items()
        ):
            raise ValueError("env_vars must map names to string values")
        return value

    @model_validator(mode="after")
    def _cross_checks(self) -> JobSpec:
        secrets_problem = conflict(self.secrets, self.runtime_env)
        if secrets_problem:
            raise field_error(*secrets_problem, None)
        deps_problem = dependency_problem(self.depends_on)
        if deps_problem:
            raise field_error(("depends_on", *deps_problem[0]), deps_problem[1], None)
        ref_problem = reference_problem(self.config, self.depends_on)
        if ref_problem:
            raise field_error(tuple(ref_problem[0].split(".", 1)), ref_problem[1], None)
        res = self.resources
        for size in range(res.min_workers, res.max_workers + 1):  # an elastic job may run at any size of its range
            self.strategy.check_against(use_gpu=res.use_gpu, num_workers=size)
        too_deep = self.nesting_problem(MAX_SPEC_DEPTH)
        if too_deep:
            field, where = too_deep
            message = f"nested deeper than {MAX_SPEC_DEPTH} levels, the most any spec may have (at {where})"
            raise field_error(tuple(field.split(".")), message, None)
        return self

    def nesting_problem(self, limit: int) -> tuple[str, str] | None:
        """(the field, where) when the spec nests deeper than `limit` objects and arrays, the spec being level 1."""
        path = _too_deep(self, limit, "")
        if path is None:
            return None
        # The field: the spec's own fields down to the free-form value (config, runtime_env, a DeepSpeed config).
        field = path.split("[", 1)[0]
        for free_form in ("strategy.deepspeed.config", "config", "runtime_env"):
            if field == free_form or field.startswith(free_form + "."):
                field = free_form
                break
        shown = path if len(path) <= 120 else path[:117] + "..."
        return field, shown
