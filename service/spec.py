"""The job spec: one pydantic model, the single source of truth for what a user may ask.

Everything a user can get wrong is caught here, at submission, with the offending field named; checks that need
the cluster (GPUs present, fits at all) live in `service.jobs`. Workers import this module too, so it stays free of
torch and of the database.
"""

from __future__ import annotations

import math
import re
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from service import resources
from service.strategy import StrategySpec, check_finite

# Matched with fullmatch: `$` would also accept a trailing newline.
_CALLABLE = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_MEMORY = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*", re.IGNORECASE | re.ASCII)
# A checkpoint id: a positive integer that fits a 64-bit database column (ASCII digits only; "²".isdigit() is true).
_CHECKPOINT_ID = re.compile(r"[1-9][0-9]{0,17}")
_MEMORY_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "ki": 1024, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mi": 1024**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gi": 1024**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "ti": 1024**4, "tib": 1024**4,
}  # fmt: skip
RECIPES = ("causal-lm",)
# Ray runtime_env keys shunter passes through untouched; anything else is a typo worth a 422.
RUNTIME_ENV_KEYS = frozenset(
    {"working_dir", "py_modules", "pip", "uv", "conda", "env_vars", "excludes", "config", "image_uri", "container"}
)


class StrictModel(BaseModel):
    """Unknown fields are errors: a misspelt option must not be silently ignored."""

    # NaN and infinity are not JSON: a spec holding one would not come back the same from the database.
    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False)


def parse_memory(value: str | int | float) -> int:
    """'64GiB' -> bytes. Plain numbers are bytes, as Ray counts memory."""
    if isinstance(value, int | float):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"memory must be a finite number of bytes, got {value!r}")
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


class Entrypoint(StrictModel):
    """Exactly one of: a train loop callable, an unchanged torchrun-style script, a built-in recipe."""

    callable: str | None = Field(None, description="`module:function`, a train_loop_per_worker(config)")
    script: str | None = Field(None, description="path of a torchrun-style script, run in every worker")
    args: list[str] = Field(default_factory=list, description="arguments for `script`")
    recipe: str | None = Field(None, description="a built-in recipe: causal-lm")

    @field_validator("callable")
    @classmethod
    def _callable_form(cls, value: str | None) -> str | None:
        if value is not None and not _CALLABLE.fullmatch(value):
            raise ValueError(f"must be 'module:function' (e.g. examples.mlp:train_loop), got {value!r}")
        return value

    @field_validator("recipe")
    @classmethod
    def _known_recipe(cls, value: str | None) -> str | None:
        if value is not None and value not in RECIPES:
            raise ValueError(f"unknown recipe {value!r}; known: {', '.join(RECIPES)}")
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> Entrypoint:
        given = [k for k in ("callable", "script", "recipe") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of callable, script, recipe (got {', '.join(given) or 'none'})")
        if self.args and not self.script:
            raise ValueError("args are only for script entrypoints")
        return self

    @property
    def kind(self) -> Literal["callable", "script", "recipe"]:
        if self.callable:
            return "callable"
        return "script" if self.script else "recipe"


class Placement(str, Enum):
    pack = "pack"
    spread = "spread"
    strict_pack = "strict_pack"
    strict_spread = "strict_spread"

    @property
    def ray_strategy(self) -> str:
        return self.value.upper()


class Resources(StrictModel):
    num_workers: int = Field(1, ge=1, le=4096)
    use_gpu: bool = False
    resources_per_worker: dict[str, float | int | str] = Field(default_factory=dict)
    placement: Placement = Placement.pack

    @field_validator("resources_per_worker")
    @classmethod
    def _amounts(cls, value: dict[str, float | int | str]) -> dict[str, float | int | str]:
        for key, amount in value.items():
            if key == "memory":
                parse_memory(amount)
            elif isinstance(amount, str) or amount < 0:
                raise ValueError(f"{key}: amount must be a non-negative number, got {amount!r}")
        return value

    @model_validator(mode="after")
    def _gpu_consistent(self) -> Resources:
        gpus = self.resources_per_worker.get("GPU")
        if gpus and not self.use_gpu:
            raise ValueError("resources_per_worker.GPU is set but use_gpu is false")
        return self

    def per_worker(self) -> dict[str, float]:
        """The Ray resources one worker holds, with shunter's defaults filled in (1 CPU; 1 GPU if use_gpu)."""
        out: dict[str, float] = {"CPU": 1.0}
        if self.use_gpu:
            out["GPU"] = 1.0
        for key, amount in self.resources_per_worker.items():
            out[key] = float(parse_memory(amount)) if key == "memory" else float(amount)
        return {k: v for k, v in out.items() if v > 0}

    def total(self) -> dict[str, float]:
        return resources.scaled(self.per_worker(), self.num_workers)


class Retries(StrictModel):
    max_worker_failures: int = Field(0, ge=0, le=100, description="worker-group restarts inside one attempt")
    max_attempts: int = Field(1, ge=1, le=100, description="whole runs by shunter, each resuming from a checkpoint")
    backoff_seconds: float = Field(30.0, ge=0, le=86400)
    max_backoff_seconds: float = Field(600.0, ge=0, le=86400)
    retry_on_timeout: bool = Field(False, description="a timed-out attempt is retried only when asked")


class CheckpointSpec(StrictModel):
    storage: str | None = Field(None, description="local path or fsspec/pyarrow URI; default from settings")
    keep: int = Field(3, ge=1, le=1000)
    resume_from: str = Field("latest", description="latest | none | the id of one of the job's checkpoints")

    @field_validator("resume_from")
    @classmethod
    def _resume_form(cls, value: str) -> str:
        if value not in ("latest", "none") and not _CHECKPOINT_ID.fullmatch(value):
            raise ValueError(
                f"must be 'latest', 'none' or a checkpoint id (a positive number of at most 18 digits, no leading "
                f"zeros), got {value!r}"
            )
        return value

    @property
    def checkpoint_id(self) -> int | None:
        """The checkpoint `resume_from` names by id; None for latest / none."""
        return int(self.resume_from) if _CHECKPOINT_ID.fullmatch(self.resume_from) else None


class JobSpec(StrictModel):
    """What a user submits (YAML or JSON)."""

    name: str = Field("job", description="a label; need not be unique")
    queue: str = Field("default", pattern=r"^[a-z0-9][a-z0-9_-]{0,63}$")
    priority: int = Field(0, ge=-1000, le=1000)
    entrypoint: Entrypoint
    config: dict[str, Any] = Field(default_factory=dict, description="handed to the train loop / recipe")
    strategy: StrategySpec = Field(default_factory=StrategySpec)
    resources: Resources = Field(default_factory=Resources)
    retries: Retries = Field(default_factory=Retries)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    runtime_env: dict[str, Any] = Field(default_factory=dict)
    timeout_seconds: float | None = Field(None, gt=0, le=30 * 86400)

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
        self.strategy.check_against(use_gpu=self.resources.use_gpu, num_workers=self.resources.num_workers)
        return self
