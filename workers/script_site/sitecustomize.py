"""shunter's start-up hook for a script-mode child: every Hugging Face `Trainer` the unchanged script makes gets a
`workers.hf_callback.ShunterCallback`.

This directory (`workers.script_progress.SITE_DIR`; a path entry, not a package) is put first on the child's
PYTHONPATH, and Python's `site` imports `sitecustomize` at start-up. Only when `SHUNTER_SCRIPT_CONTROL` is set (the
parent's control directory; `workers.script_progress.ENV_SCRIPT_CONTROL`), a finder is put first on `sys.meta_path`
that waits for `transformers.trainer` (the module defining `Trainer`) to be imported by the script. It finds the module
as the other finders would, lets its loader run it unchanged, then wraps `Trainer.__init__` to add the callback after
the original init, once per instance. Nothing is imported here otherwise: a script that never imports transformers
never loads it (nor torch, nor `workers`). Anything that goes wrong here is reported in one line on stderr and
otherwise ignored: the hook must never break the script.

With `SHUNTER_SCRIPT_CONTROL` set it also registers faulthandler for SIGUSR1 (two C modules of the standard library,
no import of `workers`): shunter's stack dump of a stalled attempt (`workers.stacks`) signals the script process too,
and its stacks go out on stderr, which its train worker forwards into the attempt's log.

The user's own `sitecustomize` (a distribution's, a virtualenv's, or one of their PYTHONPATH), which this one hides,
is chained to: the next `sitecustomize` found on `sys.path` after this directory is run as well, under the same name,
before the hook is installed. It is kept as `CHAINED` here.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

ENV_SCRIPT_CONTROL = "SHUNTER_SCRIPT_CONTROL"
TARGET = "transformers.trainer"
HERE = os.path.dirname(os.path.abspath(__file__))
CHAINED: ModuleType | None = None  # the user's sitecustomize, when there is one


def _note(what: str, exc: BaseException) -> None:
    try:  # noqa: SIM105 - contextlib is one more import at every start-up
        sys.stderr.write(f"shunter: {what}: {type(exc).__name__}: {exc}\n".replace("\n", " ").rstrip() + "\n")
    except Exception:  # noqa: BLE001 - never break the script
        pass


def _same_dir(entry: str) -> bool:
    try:
        return os.path.samefile(entry or os.getcwd(), HERE)
    except OSError:
        return False


def _chain() -> ModuleType | None:
    """Run the next `sitecustomize` on sys.path after this directory, as Python would have without it."""
    entries = list(sys.path)
    ours = [i for i, entry in enumerate(entries) if _same_dir(entry)]
    rest = entries[ours[0] + 1 :] if ours else entries
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [e for e in rest if not _same_dir(e)])
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _add_callback(trainer: Any) -> None:
    if getattr(trainer, "_shunter_callback", False):
        return
    trainer._shunter_callback = True
    from workers.hf_callback import ShunterCallback

    if not any(isinstance(cb, ShunterCallback) for cb in trainer.callback_handler.callbacks):
        trainer.add_callback(ShunterCallback())


def _patch(module: ModuleType) -> None:
    """Wrap `module.Trainer.__init__` (once) to add the callback after the original init."""
    import functools

    trainer_class = module.Trainer
    original = trainer_class.__init__
    if getattr(original, "_shunter_wrapped", False):
        return

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        try:
            _add_callback(self)
        except Exception as exc:  # noqa: BLE001 - never break the script
            _note("the Trainer runs without shunter's callback", exc)

    functools.update_wrapper(__init__, original)  # inspect.signature(Trainer.__init__) stays the original's
    __init__._shunter_wrapped = True  # type: ignore[attr-defined]  # a mark on a function object
    trainer_class.__init__ = __init__


class TrainerHook:
    """A `sys.meta_path` finder for `transformers.trainer` alone: the spec is the other finders', its loader's
    `exec_module` is wrapped for this one load (an instance attribute, removed once it ran) to patch the module."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != TARGET:
            return None
        try:
            spec = self._spec(fullname, path, target)
            loader = spec.loader if spec is not None else None
            if loader is not None and hasattr(loader, "exec_module"):
                self._wrap(loader)
            return spec
        except Exception as exc:  # noqa: BLE001 - never break the script
            _note("no Trainer callback (import hook)", exc)
            return None  # the other finders find it as if this one were not there

    def _spec(self, fullname: str, path: Any, target: Any) -> Any:
        for finder in sys.meta_path:
            if finder is self or isinstance(finder, TrainerHook):
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                return spec
        return None

    def _wrap(self, loader: Any) -> None:
        original = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            if getattr(module, "__name__", None) != TARGET:  # a loader shared by several modules (a zipimporter)
                return original(module)
            try:
                original(module)
            finally:
                loader.__dict__.pop("exec_module", None)
            try:
                _patch(module)
                if self in sys.meta_path:
                    sys.meta_path.remove(self)  # done: Trainer is patched for this process
            except Exception as exc:  # noqa: BLE001 - never break the script
                _note("no Trainer callback (patching Trainer)", exc)

        loader.exec_module = exec_module


def _install() -> None:
    if TARGET in sys.modules:  # imported before site ran (not by a normal start-up): patch it where it is
        _patch(sys.modules[TARGET])
    elif not any(isinstance(finder, TrainerHook) for finder in sys.meta_path):
        sys.meta_path.insert(0, TrainerHook())


try:
    CHAINED = _chain()
except Exception as exc:  # noqa: BLE001 - as Python's own site does for a failing sitecustomize
    _note("the next sitecustomize failed", exc)


def _register_stack_dump() -> None:
    """As `workers.stacks.register`: every thread's stack to stderr on SIGUSR1."""
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)


if os.environ.get(ENV_SCRIPT_CONTROL):
    try:
        _register_stack_dump()
    except Exception as exc:  # noqa: BLE001 - never break the script
        _note("no stack dump on SIGUSR1", exc)
    try:
        _install()
    except Exception as exc:  # noqa: BLE001 - never break the script
        _note("no Trainer callback (installing the import hook)", exc)
