"""Built-in recipes: train loops shunter ships, chosen by `entrypoint.recipe` and configured by `config:`."""

from __future__ import annotations

# recipe name -> its train loop, as an `entrypoint.callable` (imported on the workers: workers.train_loop.UserCallable)
RECIPE_LOOPS = {"causal-lm": "workers.recipes.causal_lm:train_loop"}


def recipe_target(name: str) -> str:
    """The `module:attribute` of a built-in recipe's train_loop_per_worker."""
    try:
        return RECIPE_LOOPS[name]
    except KeyError:
        raise ValueError(f"entrypoint.recipe: unknown recipe {name!r}") from None
