"""Drain notices: a node of this job will be taken away (a spot reclaim, an autoscaler's scale-down, an operator's
`ray drain-node`), announced ahead with a deadline.

Ray 2.60's Train watches Ray Core's drain state for the nodes of a worker group and hands the notice to every worker;
`ray.train.get_preemption_info()` returns it, agreed across ranks (it is a broadcast from rank 0, so every rank must
call it as often as the others: shunter calls it once in each `Prepared.report`, which every rank makes).

On a notice, shunter's report path checkpoints at once on every rank and then stops the attempt cleanly
(`NodeDraining`, caught by `workers.train_loop.run_loop`, which returns `drained(...)` as the loop's value). The driver
records the attempt's end as `node_draining`; the dispatcher retries it from that checkpoint at once, without counting
it against `max_attempts`, on what the cluster has left without the draining node (an elastic job at the size that
fits). Nothing is trained between the checkpoint and the stop, so no step is lost, and the worker group's room on the
other nodes is free for the retry before the deadline, not after it.

Script mode: the Ray worker that runs the script passes the notice on in a file (`watch_for_script`); the HF
`Trainer` callback (`workers.hf_callback`) agrees on it across the script's ranks at a step's end, saves and ends
training there, and the worker then stops the attempt the same way (`script_stopped`).

A loop that never reports through shunter's helpers is not asked: it trains on until the deadline, when Ray Train
tears its group down (`PreemptionError`, recorded as `node_draining` too), and resumes from its last checkpoint.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

DRAINED = "shunter:node_draining"  # the train loop's return value on every rank after a drain stop
_answered = False  # one notice per attempt: after it, the attempt ends


class NodeDraining(BaseException):  # noqa: N818 - a stop, like KeyboardInterrupt, not an error
    """Raised by the report helper on every rank once the drain checkpoint is written: the loop ends here.

    A BaseException, so that a loop's own `except Exception` around a step cannot swallow it."""

    def __init__(self, notice: dict[str, Any], step: int | None) -> None:
        super().__init__(describe(notice, step))
        self.notice, self.step = notice, step


def notice() -> dict[str, Any] | None:
    """The drain notice for this attempt's nodes, the same on every rank; None when there is none (or outside Ray
    Train, or on a Ray without it). A barrier: every rank must call it at the same point of its loop."""
    global _answered
    if _answered:
        return None
    try:
        import ray.train

        info = ray.train.get_preemption_info()
    except (AttributeError, ImportError, RuntimeError):  # not in a Train worker, or a Ray before 2.60
        return None
    if info is None:
        return None
    _answered = True
    return _as_dict(info)


def _as_dict(info: Any) -> dict[str, Any]:
    """A `ray.train.PreemptionInfo` as plain JSON, with when this worker saw it."""
    return {
        "nodes": list(info.preempted_node_ids),
        "ranks": list(info.preempted_ranks),
        "deadline_ms": info.deadline_ms,
        "seen_ms": int(time.time() * 1000),
    }


def drained(stop: NodeDraining) -> dict[str, Any]:
    """What a drain-stopped loop returns (rank 0's value becomes the run's `Result.return_value`)."""
    return {"shunter": DRAINED, "notice": stop.notice, "step": stop.step}


def drained_value(value: Any) -> dict[str, Any] | None:
    """The drain record in a run's return value, or None when the run ended on its own."""
    if isinstance(value, dict) and value.get("shunter") == DRAINED:
        return value
    return None


def describe(notice: dict[str, Any], step: int | None) -> str:
    """One line for the attempt's end: which nodes, how long before the deadline, where the checkpoint is."""
    nodes = ", ".join(str(n) for n in notice.get("nodes") or []) or "a node"
    ranks = notice.get("ranks") or []
    deadline, seen = notice.get("deadline_ms"), notice.get("seen_ms")
    ahead = (
        f", {max(0.0, (deadline - seen) / 1000):.0f}s before its deadline"
        if isinstance(deadline, int) and isinstance(seen, int) and deadline
        else " (no deadline given)"
    )
    where = f"at step {step}" if step is not None else "at once"
    return (
        f"node draining: {nodes} (ranks {ranks}) announced its end{ahead}; checkpointed {where} on every rank and "
        f"stopped, to resume on the nodes that stay"
    )


# ---- script mode: the script runs in a child process, so its HF Trainer callback is told through files ---------
DRAIN_FILE = "drain"  # in the script's control directory: the notice, written by the Ray worker that runs the script
DRAINED_FILE = "drained"  # written by the script's Trainer callback once it saved on the notice and stopped
WATCH_SECONDS = 1.0


def local_notice() -> dict[str, Any] | None:
    """This worker's own copy of the notice, without the barrier of `notice()` (a watcher thread may ask): Ray Train
    marks every worker of the group when a node of it drains."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        info = get_train_context().preemption_context.preemption_info
    except Exception:  # noqa: BLE001 - private to Ray: without it, script mode gets the plain path
        return None
    return None if info is None else _as_dict(info)


def watch_for_script(control: Path, stop: threading.Event) -> threading.Thread:
    """Pass the notice on to the script (`DRAIN_FILE` in its control directory) once Ray Train has it."""

    def watch() -> None:
        while not stop.wait(WATCH_SECONDS):
            seen = local_notice()
            if seen is not None:
                control.mkdir(parents=True, exist_ok=True)
                partial = control / f".{DRAIN_FILE}.tmp"
                partial.write_text(json.dumps(seen))
                os.replace(partial, control / DRAIN_FILE)
                return

    thread = threading.Thread(target=watch, name="shunter-drain-watch", daemon=True)
    thread.start()
    return thread


NOTICE_PATIENCE_SECONDS = 10.0


def script_stopped(control: Path, *, patience_s: float = NOTICE_PATIENCE_SECONDS) -> NodeDraining | None:
    """The stop of a script whose Trainer saved on the notice and ended training (`DRAINED_FILE`), or None.

    The ranks agree on a notice when any rank's worker passed it on, so this rank's script may have saved and ended
    before its own watcher wrote `DRAIN_FILE` (Ray Train hands the notice to the workers one by one; CI saw rank 0
    get it after rank 1's script had saved). Such a rank still stops: its copy of the notice is Ray Train's, waited
    for up to `patience_s`, since rank 0's names the nodes the dispatcher checks. Going on as if training had ended
    would leave it waiting at Ray Train's barrier for ranks that stopped, until the node's deadline."""
    try:
        step = json.loads((control / DRAINED_FILE).read_text()).get("step")
    except (OSError, ValueError):
        return None
    seen = _passed_on(control)
    deadline = time.monotonic() + patience_s
    while seen is None:
        seen = local_notice()
        if seen is not None or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    return NodeDraining(seen or {}, step if isinstance(step, int) else None)


def _passed_on(control: Path) -> dict[str, Any] | None:
    try:
        seen = json.loads((control / DRAIN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return seen if isinstance(seen, dict) else None


def mark_script_drained(control: Path, step: int) -> None:
    partial = control / f".{DRAINED_FILE}.{os.getpid()}.tmp"
    partial.write_text(json.dumps({"step": step}))
    os.replace(partial, control / DRAINED_FILE)
