"""Number fields that mean what they say: JSON `true` is not 1, and `false` is not 0.

pydantic's lax mode reads a bool as a number; its strict mode refuses `2.0` for an integer, which JSON Schema calls
an integer. Models that inherit `NoBoolNumbers` refuse a bool for any int or float field and otherwise validate as
lax mode does, and their JSON schema stays plain `integer` / `number` with its bounds.
"""

from __future__ import annotations

import functools
import types
import typing
from typing import Any, cast

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

INT32_MAX = 2**31 - 1  # PostgreSQL's INTEGER: row ids, steps


@functools.lru_cache(maxsize=1024)
def _numeric(annotation: Any) -> bool:
    """Whether a field's annotation is a number (int or float), optionally with None, and not also a bool."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    kinds = set(args or (annotation,)) - {type(None)}
    return bool(kinds) and kinds <= {int, float}


class NoBoolNumbers(BaseModel):
    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        if (
            isinstance(value, bool)
            and info.field_name
            and _numeric(cast(Any, cls.model_fields[info.field_name].annotation))
        ):
            raise ValueError("must be a number, not true/false")
        return value


class StrictModel(NoBoolNumbers):
    """Unknown fields are errors: a misspelt option must not be silently ignored."""

    # NaN and infinity are not JSON: a spec holding one would not come back the same from the database.
    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False)
