"""What a job's `entrypoint` runs: the train loop the driver hands to its TorchTrainer.

It sits above the strategies, the recipes and script mode, which it chooses between; none of them imports it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from workers.stacks import register as register_stack_dump

if TYPE_CHECKING:
    from service.spec.job import JobSpec


def train_loop_for(spec: JobSpec) -> tuple[Callable[[dict[str, Any]], None], dict[str, Any]]:
    """(train_loop_per_worker, train_loop_config) for the job's entrypoint, for the driver's TorchTrainer.

    Whatever the entrypoint, the loop first tells shunter which checkpoint Ray Train restored for it, if any
    (`workers.progress.report_restored`)."""
    loop, config = _user_loop(spec)
    # Script mode says it started once every rank's script process is up (workers.script), not before.
    checks = spec.preflight.model_dump(mode="json")
    # The attempt token rides with the loop, as a Ray task argument: never in the environment Ray's records show.
    from workers.context import credential

    return functools.partial(run_loop, loop=loop, announce=not spec.entrypoint.script, preflight=checks,
                             token=Token(credential())), config  # fmt: skip


@dataclass(frozen=True)
class Token:
    """The attempt token as an argument: its repr, in a traceback or Ray's task listing, does not show it."""

    value: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class UserCallable:
    """The job's `entrypoint.callable` (`module:attribute`), imported where it runs: on the workers."""

    target: str

    def resolve(self) -> Callable[..., Any]:
        module_name, _, attr = self.target.partition(":")
        found: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            found = getattr(found, part)
        if not callable(found):
            raise TypeError(f"entrypoint.callable: {self.target} is not callable")
        return found


def run_loop(
    config: dict[str, Any],
    *,
    loop: Callable[..., Any] | UserCallable,
    announce: bool = True,
    preflight: dict[str, Any] | None = None,
    token: Token | None = None,
) -> Any:
    """Run the job's own train loop on this worker, after the pre-flight check (`workers.preflight`, when the spec's
    `preflight` is enabled), after rank 0 has reported the checkpoint it resumes from and, with `announce`, that every
    rank's loop has started (RUNNING); the loop is called as Ray Train would call it (with the config when it takes an
    argument). A loop stopped by a drain notice returns `workers.drain.drained`; one that returns on its own then
    says so (`workers.progress.announce_finished`), which is the word the attempt succeeds on. First of all, the
    working directory is checked against the code archive the service recorded (`workers.proof.verify_code`):
    StorageTampered, and nothing of the job's is imported. Before that, the rank keeps the attempt token the driver
    gave it (`token`), and after it, sets the job's secrets in its environment (`workers.context.load_secrets`)."""
    from workers import context
    from workers.proof import verify_code

    context.adopt(token.value if token else None)  # the attempt's token, from the driver (a task argument)
    verify_code()  # this node's working directory is the owner's code archive, before any of it is imported
    context.load_secrets()  # the job's secrets in this rank's environment, before any of its code runs
    if isinstance(loop, UserCallable):
        loop = loop.resolve()  # the job's own code, imported here first (a bad name fails every rank: user_error)
    register_stack_dump()  # SIGUSR1 prints this worker's stacks into the attempt's log (a stall: workers.stacks)
    from workers.drain import NodeDraining, drained
    from workers.progress import announce_finished, announce_started, report_restored

    checked = preflight is not None and preflight.get("enabled", True)
    if checked and preflight is not None:
        from workers import preflight as check

        check.run(preflight)  # raises PreflightFailed, naming the rank and node at fault
    report_restored()
    if announce:
        # A check that passed ran collectives every rank took part in: they have all started, no barrier needed.
        announce_started(barrier=not checked)
    try:
        value = loop(config) if _takes_config(loop) else loop()
    except NodeDraining as stop:  # the drain checkpoint is written on every rank: end the run cleanly
        return drained(stop)
    announce_finished()  # the attempt succeeds on this, not when Ray Train's teardown lets `fit()` return
    return value


def _takes_config(loop: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(loop).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): Ray Train would pass the config
        return True
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in parameters)


def _user_loop(spec: JobSpec) -> tuple[Callable[..., Any] | UserCallable, dict[str, Any]]:
    entry = spec.entrypoint
    if entry.callable:
        module_name = entry.callable.partition(":")[0]
        # Here, only that the module is there (a missing one fails the attempt at once, before any worker starts);
        # the workers import it (`UserCallable`), so that neither this driver nor Ray Train's controller imports
        # the user's code, and torch with it.
        if importlib.util.find_spec(module_name) is None:
            raise ModuleNotFoundError(f"entrypoint.callable: no module named {module_name!r}", name=module_name)
        return UserCallable(entry.callable), dict(spec.config)
    if entry.script:
        from workers.script import run_script

        return run_script, {"script": entry.script, "args": list(entry.args), "outputs": list(entry.outputs),
                            "resume_arg": entry.resume_arg}  # fmt: skip
    from workers.recipes import recipe_target

    return UserCallable(recipe_target(entry.recipe or "")), dict(spec.config)
