"""Built-in recipes: train loops shunter ships, chosen by `entrypoint.recipe` and configured by `config:`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def recipe_loop(name: str) -> Callable[[dict[str, Any]], None]:
    """The train_loop_per_worker of a built-in recipe."""
    if name == "causal-lm":
        from workers.recipes.causal_lm import train_loop

        return train_loop
    raise ValueError(f"entrypoint.recipe: unknown recipe {name!r}")
