"""A Hugging Face `Trainer` callback that carries a script-mode job's progress and checkpoints to shunter.

The `sitecustomize` in `workers.script_progress.SITE_DIR` adds it to every `Trainer` an unchanged script makes (a
script may also pass `callbacks=[ShunterCallback()]` itself; it is never added twice). It runs inside the script's
process:

- `on_log` (world process zero only): the logs' finite numbers, at the true `state.global_step`, through
  `workers.report` (which sends nothing outside shunter);
- `on_save` (every process, each may write files of its own into the folder): `saved/checkpoint-<global_step>@<local
  rank>` in the control directory (`SHUNTER_SCRIPT_CONTROL`), holding the checkpoint's absolute path; once every
  local rank of a node marked it, that node's output syncer may seal its part of the checkpoint;
- `on_step_end` (every process): a drain notice its Ray worker passed on (`workers.drain.DRAIN_FILE`), agreed across
  ranks, saves at that step and ends training; `on_save` then marks `drained`, and the attempt stops there;
- when made: `hf-callback` in the control directory, which tells the parent's stdout reader
  (`workers.script_progress.StdoutProgress`) to leave the Trainer's printed logs to this callback.

Like all of shunter's progress, it never fails the training: errors are logged and skipped.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from workers.script_progress import CallbackMarkers

log = logging.getLogger(__name__)


def numeric_logs(logs: dict[str, Any] | None) -> dict[str, float]:
    """The finite numbers (not bools) of a Trainer log, without a `step` key (the step is the global step)."""
    out = {}
    for key, value in (logs or {}).items():
        if key == "step" or not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        try:
            if math.isfinite(value):
                out[key] = value
        except OverflowError:
            continue
    return out


class ShunterCallback(TrainerCallback):
    def __init__(self) -> None:
        self.markers = CallbackMarkers.from_env()  # None outside shunter's script mode
        self.draining = False  # saving on a drain notice, then stopping
        if self.markers is not None:
            try:
                self.markers.callback_started()
            except OSError as exc:
                log.warning("shunter: could not mark the Trainer callback in %s: %s", self.markers.control_dir, exc)

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        if not state.is_world_process_zero:
            return
        from workers import report

        report(step=state.global_step, **numeric_logs(logs))

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """On a drain notice (agreed across the script's ranks): save at this step and end training."""
        if self.markers is None or self.draining:
            return
        if drain_agreed(self.markers.control_dir):
            self.draining = True
            control.should_save = True
            control.should_training_stop = True
            log.warning("shunter: a node of this job is draining: saving at step %d and stopping", state.global_step)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.markers is None:
            return
        if not args.output_dir:  # Trainer saves nowhere then
            return
        checkpoint = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")  # Trainer._save_checkpoint's
        try:
            self.markers.checkpoint_saved(checkpoint, local_rank=int(os.environ.get("LOCAL_RANK") or 0))
            if self.draining:
                from workers.drain import mark_script_drained

                mark_script_drained(self.markers.control_dir, state.global_step)
        except OSError as exc:
            log.warning("shunter: could not mark checkpoint %s as saved: %s", checkpoint, exc)


def drain_agreed(control_dir: os.PathLike[str] | str) -> bool:
    """Whether the Ray worker of any rank passed on a drain notice (`workers.drain.DRAIN_FILE`): every rank's own view,
    agreed by an all-reduce in the script's process group, so that all of them save at the same step."""
    from workers.drain import DRAIN_FILE
    from workers.ranks import any_rank

    return any_rank(os.path.exists(os.path.join(control_dir, DRAIN_FILE)))
