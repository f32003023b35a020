"""The job's entrypoint: what it runs (a train loop callable, an unchanged script, a built-in recipe) and, for a
script, the outputs shunter keeps and the option a retry resumes with. Part of the job spec (`service.spec.job`)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from service.core.numbers import StrictModel

_CALLABLE = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*")
RECIPES = ("causal-lm",)

# The entrypoint's rules in its JSON schema, so a client (or a fuzzer) reading the OpenAPI document knows them:
# exactly one of callable / script / recipe is given (an empty script counts as not given), and args, outputs and
# resume_arg only with a script. Each branch is what `Entrypoint._exactly_one` accepts, no more and no less.
_SCRIPT_NOT_GIVEN = {"anyOf": [{"type": "null"}, {"const": ""}]}
# An output directory: a relative path below the script's working directory, no `.`/`..` part, no empty part.
_OUTPUT_PART = r"(?:[A-Za-z0-9_-]|\.[A-Za-z0-9_-]|\.\.[A-Za-z0-9_.-])[A-Za-z0-9_.-]*"
_OUTPUT_PATH = re.compile(f"^{_OUTPUT_PART}(?:/{_OUTPUT_PART})*$")
_RESUME_ARG = re.compile(r"^--?[A-Za-z0-9][A-Za-z0-9_.-]*$")
MAX_OUTPUTS = 16
MAX_OUTPUT_PATH = 256
_ENTRYPOINT_ONE_OF: Any = [
    {
        "title": "callable",
        "required": ["callable"],
        "properties": {"callable": {"type": "string"}, "script": _SCRIPT_NOT_GIVEN, "recipe": {"type": "null"},
                       "args": {"maxItems": 0}, "outputs": {"maxItems": 0}, "resume_arg": {"type": "null"}},
    },
    {
        "title": "script",
        "required": ["script"],
        "properties": {"script": {"type": "string", "minLength": 1}, "callable": {"type": "null"},
                       "recipe": {"type": "null"}},
    },
    {
        "title": "recipe",
        "required": ["recipe"],
        "properties": {"recipe": {"type": "string"}, "callable": {"type": "null"}, "script": _SCRIPT_NOT_GIVEN,
                       "args": {"maxItems": 0}, "outputs": {"maxItems": 0}, "resume_arg": {"type": "null"}},
    },
]  # fmt: skip


class Entrypoint(StrictModel):
    """Exactly one of: a train loop callable, an unchanged torchrun-style script, a built-in recipe."""

    model_config = ConfigDict(json_schema_extra={"oneOf": _ENTRYPOINT_ONE_OF})

    callable: str | None = Field(
        None,
        description="`module:function`, a train_loop_per_worker(config)",
        json_schema_extra={"pattern": f"^{_CALLABLE.pattern}$"},
    )
    script: str | None = Field(None, description="path of a torchrun-style script, run in every worker")
    args: list[str] = Field(default_factory=list, description="arguments for `script`")
    outputs: list[
        Annotated[str, Field(max_length=MAX_OUTPUT_PATH, json_schema_extra={"pattern": _OUTPUT_PATH.pattern})]
    ] = Field(
        default_factory=list,
        max_length=MAX_OUTPUTS,
        json_schema_extra={"uniqueItems": True},
        description="directories the script writes, relative to its working directory (e.g. `out`): kept in "
        "`<storage>/<job>/outputs/<dir>`, their checkpoint folders listed and put back on a retry",
    )
    resume_arg: str | None = Field(
        None,
        min_length=2,
        max_length=128,
        json_schema_extra={"pattern": _RESUME_ARG.pattern},
        description="an option (e.g. `--resume_from_checkpoint`) appended with the path of the newest complete "
        "output checkpoint when a retry has one",
    )
    recipe: str | None = Field(
        None, description="a built-in recipe: causal-lm", json_schema_extra={"enum": [*RECIPES, None]}
    )

    @field_validator("callable")
    @classmethod
    def _callable_form(cls, value: str | None) -> str | None:
        if value is not None and not _CALLABLE.fullmatch(value):
            raise ValueError(f"must be 'module:function' (e.g. examples.mlp:train_loop), got {value!r}")
        return value

    @field_validator("outputs")
    @classmethod
    def _relative_dirs(cls, outputs: list[str]) -> list[str]:
        for i, path in enumerate(outputs):
            if not _OUTPUT_PATH.fullmatch(path):
                raise ValueError(
                    f"outputs[{i}]: {path[:80]!r} must be a directory below the script's working directory, like "
                    "out or runs/a (no leading /, no . or .. part, no empty part)"
                )
        return outputs

    @field_validator("resume_arg")
    @classmethod
    def _an_option(cls, value: str | None) -> str | None:
        if value is not None and not _RESUME_ARG.fullmatch(value):
            raise ValueError(f"must be a command-line option like --resume_from_checkpoint, got {value[:80]!r}")
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
        for name in ("args", "outputs", "resume_arg"):
            if getattr(self, name) and not self.script:
                raise ValueError(f"{name} is only for script entrypoints")
        if len(set(self.outputs)) != len(self.outputs) or any(
            a != b and (a.startswith(b + "/") or b.startswith(a + "/")) for a in self.outputs for b in self.outputs
        ):
            raise ValueError("outputs: each directory once, none inside another")
        return self

    @property
    def kind(self) -> Literal["callable", "script", "recipe"]:
        if self.callable:
            return "callable"
        return "script" if self.script else "recipe"
