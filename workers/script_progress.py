"""Progress of a script-mode job (`entrypoint.script`), read from what the unchanged script already does.

A script run by `workers.script` knows nothing of Ray Train, so nothing reports its step or loss. Two ways in, neither
asking the script to change:

- Its stdout. Rank 0's lines are fed to `StdoutProgress`, which reports the ones `parse_line` recognises: a line that
  is exactly one JSON object with a `step` (the documented format: `print(json.dumps({"step": 12, "loss": 0.5}))`),
  and the log dicts Hugging Face's `Trainer` prints (`{'loss': '2.31', 'grad_norm': '1.2', 'epoch': '0.33'}`).
- A `Trainer` callback (`workers.hf_callback.ShunterCallback`), added to every `Trainer` the script makes by the
  `sitecustomize` in `SITE_DIR`, which the parent puts first on the child's PYTHONPATH. It reports each log with the
  true `global_step` and leaves a marker per saved checkpoint for the parent's output syncer.

The parent makes a control directory per child and names it in `SHUNTER_SCRIPT_CONTROL` (`child_env`); the child
writes markers there (`CallbackMarkers`): `hf-callback` once a callback exists, so that the same logs are not also
reported from stdout (with a made-up step), and `saved/<checkpoint-N>` holding the checkpoint's absolute path.

The reader never waits on the API: the script's output must not stall (a full pipe blocks the script). Points go to
a queue that one sender thread empties in order; while the API is away the sender keeps them and tries again, and
the queue holds at most `MAX_PENDING` points (the oldest go first). At the script's end the parent waits up to
`FLUSH_SECONDS` for the queue to empty (`close`), so the last points, a run's final loss among them, are recorded
before the attempt's end is. A point the API refuses (a 4xx) is dropped; nothing here ever fails a training run.
This module is imported by the parent (a Ray Train worker) and must stay free of torch, Ray and transformers.
"""

from __future__ import annotations

import ast
import json
import logging
import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.attempt_api import AttemptApi, transient

log = logging.getLogger(__name__)

SITE_DIR = Path(__file__).resolve().parent / "script_site"  # holds sitecustomize.py: first on the child's PYTHONPATH
ENV_SCRIPT_CONTROL = "SHUNTER_SCRIPT_CONTROL"  # the control directory; spelled out again in script_site/sitecustomize
HF_CALLBACK_MARKER = "hf-callback"  # made by ShunterCallback.__init__: HF logs come through the callback
SAVED_DIR = "saved"  # saved/<checkpoint dir name>, holding the checkpoint's absolute path
MAX_LINE_CHARS = 64 * 1024  # a longer line (after its last '\r') is not progress, and is not parsed
MAX_STEP = 2**31 - 1  # what the API takes (api.routes.internal.MAX_STEP)
HF_LOSS_KEYS = frozenset({"loss", "eval_loss", "train_loss"})  # a Trainer log dict has one of these
MAX_PENDING = 1000  # points waiting for the API; beyond it the oldest is dropped
FLUSH_SECONDS = 30.0  # at the script's end, how long the points still queued may take to be sent
RETRY_SECONDS = (0.25, 5.0)  # the sender's wait after a transient failure: first, and at most (doubling)


def _number(value: Any) -> float | int | None:
    """A finite int or float (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        return value if math.isfinite(value) else None
    except OverflowError:  # an int past float's range
        return None


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(text)  # NaN/Infinity parse to floats here, and are dropped later
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def _json_progress(obj: dict[str, Any]) -> dict[str, float] | None:
    step = _number(obj.get("step"))
    if step is None or not 0 <= step <= MAX_STEP or step != math.floor(step):
        return None
    values = {str(k): v for k, v in obj.items() if _number(v) is not None}
    values["step"] = int(step)
    return values


def _hf_number(value: Any) -> float | int | None:
    """A value of a Trainer log as printed: a number, or a string holding one (transformers 5 prints floats as
    `f"{v:.4g}"`)."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return None
    return _number(value)


def _hf_logs(text: str) -> dict[str, float] | None:
    try:
        obj = ast.literal_eval(text)  # literals only: never runs code
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None  # e.g. `np.float32(2.3)` reprs: a call, not a literal
    if not isinstance(obj, dict) or not HF_LOSS_KEYS & {k for k in obj if isinstance(k, str)}:
        return None
    values = {}
    for key, value in obj.items():
        number = _hf_number(value) if isinstance(key, str) and key != "step" else None
        if number is not None:
            values[key] = number
    return values  # a NaN loss is dropped, the dict still counts (its index stays the Trainer's log count)


def parse_line(line: str) -> dict[str, float] | None:
    """The progress a line of a script's stdout carries, else None.

    - exactly one JSON object with a whole `step` from 0 to 2**31-1: its finite numbers (bools, strings, lists and
      nested objects left out), `step` among them, as an int; a JSON object without one is not progress;
    - a Hugging Face `Trainer` log dict as it prints it (a Python literal dict with a `loss`, `eval_loss` or
      `train_loss` key): its finite numbers, numeric strings read as numbers (possibly none); no `step` key;
    - anything else: None. A tqdm bar's carriage returns are skipped (the text after the last '\\r' counts), and
      such a text over 64 KiB is ignored.
    """
    text = line.rpartition("\r")[2]  # a bar redrawn for minutes before the text makes one long line
    if len(text) > MAX_LINE_CHARS:
        return None
    text = text.strip()
    if not (text.startswith("{") and text.endswith("}")):
        return None
    obj = _json_object(text)  # HF's dicts are not JSON: their keys are single-quoted
    return _json_progress(obj) if obj is not None else _hf_logs(text)


class StdoutProgress:
    """Turns rank 0's stdout lines into progress reports (see the module docstring).

    JSON lines are reported at their own `step`. A Trainer log dict has no step: it is reported at its index among the
    log dicts seen (1, 2, ...), unless the child's callback exists (`hf-callback` in `control_dir`), which reports
    the same logs at their true step. `feed` never raises and never waits on the API: a point is queued for the
    sender thread; `close` waits (boundedly) for the queue to be sent.
    """

    def __init__(self, api: AttemptApi | None, control_dir: Path | None = None) -> None:
        self.api = api
        self.control_dir = control_dir
        self.reported = 0  # reports the API recorded
        self.dropped = 0  # points never recorded: refused, over MAX_PENDING, or still queued when `close` gave up
        self.failed_tries = 0  # sends that failed transiently (and were tried again)
        self._failing = 0  # failed tries since the last answer
        self._hf_index = 0
        self._callback_seen = False
        self._fenced = False  # the attempt is no longer current: nothing more would land
        self._pending: deque[tuple[dict[str, float], int]] = deque()  # its head is the point being sent
        self._closed = False
        self._changed = threading.Condition()
        self._sender: threading.Thread | None = None

    def callback_active(self) -> bool:
        """Whether the child's `ShunterCallback` reports the Trainer's logs (checked until seen, then cached)."""
        if not self._callback_seen and self.control_dir is not None:
            self._callback_seen = (self.control_dir / HF_CALLBACK_MARKER).exists()
        return self._callback_seen

    def feed(self, line: str) -> bool:
        """Read one line; True when it became a point queued for the API."""
        if self.api is None or self._fenced or self._closed:
            return False
        try:
            values = parse_line(line)
            if values is None:
                return False
            if "step" in values:
                step = int(values.pop("step"))
            elif self.callback_active():
                return False
            else:
                self._hf_index += 1
                step = self._hf_index
            self._queue(values, step)
            return True
        except Exception:  # noqa: BLE001 - see module docstring
            log.exception("shunter: could not read a progress line of the script")
            return False

    def close(self, timeout: float = FLUSH_SECONDS) -> bool:
        """No more lines: wait up to `timeout` s for the queued points to be sent. True when none is left unsent (what
        is left is dropped and counted)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            self._closed = True
            self._changed.notify_all()
            while self._pending and not self._fenced and time.monotonic() < deadline:
                self._changed.wait(deadline - time.monotonic())
            left = len(self._pending)
            self.dropped += len(self._pending)
            self._pending.clear()
            self._changed.notify_all()
        if left and not self._fenced and self.api is not None:
            log.warning("shunter: %d progress point(s) of job %s unsent after %.0fs, dropped", left, self.api.job_id,
                        timeout)  # fmt: skip
        return left == 0 or self._fenced

    def _queue(self, values: dict[str, float], step: int) -> None:
        with self._changed:
            if len(self._pending) >= MAX_PENDING:
                self._pending.popleft()
                self.dropped += 1
            self._pending.append((values, step))
            self._changed.notify_all()
            if self._sender is None:
                self._sender = threading.Thread(target=self._send_all, name="shunter-script-progress", daemon=True)
                self._sender.start()

    def _send_all(self) -> None:
        """The sender thread: the queue in order, each point until the API records or refuses it (or `close` gives
        up). The point being sent stays at the head of the queue until then."""
        delay = RETRY_SECONDS[0]
        while True:
            with self._changed:
                while not self._pending and not self._closed:
                    self._changed.wait()
                if not self._pending:
                    return
                head = self._pending[0]
            again = self._send(*head)
            with self._changed:
                if not again and self._pending and self._pending[0] is head:
                    self._pending.popleft()
                if self._fenced:
                    self.dropped += len(self._pending)
                    self._pending.clear()
                self._changed.notify_all()
                if self._fenced:
                    return
                if again:  # the API away: wait, then the same point again (`close` giving up wakes this)
                    self._changed.wait(delay)
                    delay = min(delay * 2, RETRY_SECONDS[1])
                else:
                    delay = RETRY_SECONDS[0]

    def _send(self, values: dict[str, float], step: int) -> bool:
        """One try; True when it failed transiently and is to be tried again."""
        assert self.api is not None
        try:
            recorded = self.api.report(values, step=step, patience=0.0)
        except Exception as exc:  # noqa: BLE001 - see module docstring
            if transient(exc):
                with self._changed:
                    self.failed_tries += 1
                    self._failing += 1
                if self._failing == 1:  # once per outage, not per try
                    log.warning("shunter: progress of job %s not sent yet (step %d), kept to try again: %s",
                                self.api.job_id, step, exc)  # fmt: skip
                return True
            self._failing = 0
            log.warning("shunter: progress at step %d of job %s refused: %s", step, self.api.job_id, exc)
            with self._changed:
                self.dropped += 1
            return False
        if not recorded:
            self._fenced = True
            log.warning("shunter: attempt %d of job %s is no longer current; script progress no longer reported",
                        self.api.attempt, self.api.job_id)  # fmt: skip
            return False
        with self._changed:
            self.reported += 1
            self._failing = 0
        return False


@dataclass(frozen=True)
class CallbackMarkers:
    """The control directory as the child's callback writes it (`SHUNTER_SCRIPT_CONTROL`); see the module docstring."""

    control_dir: Path

    @classmethod
    def from_env(cls) -> CallbackMarkers | None:
        value = os.environ.get(ENV_SCRIPT_CONTROL)
        return cls(Path(value)) if value else None

    def callback_started(self) -> None:
        self.control_dir.mkdir(parents=True, exist_ok=True)
        (self.control_dir / HF_CALLBACK_MARKER).write_text(f"{os.getpid()}\n")

    def checkpoint_saved(self, checkpoint_dir: str, local_rank: int = 0) -> Path:
        """Mark a checkpoint as saved by this process: `saved/<its dir name>@<local rank>` holds its absolute path
        (written whole, then renamed). Every process marks: each may write files of its own into it (HF's
        `rng_state_<rank>.pth`), so a node's part is whole once all its local ranks marked it."""
        path = os.path.abspath(checkpoint_dir)
        saved = self.control_dir / SAVED_DIR
        saved.mkdir(parents=True, exist_ok=True)
        marker = saved / f"{os.path.basename(path.rstrip(os.sep))}@{local_rank}"
        partial = saved / f".{marker.name}.{os.getpid()}.tmp"
        partial.write_text(path + "\n")
        os.replace(partial, marker)
        return marker


def saved_checkpoints(control_dir: Path, local_ranks: int = 1) -> dict[str, Path]:
    """The checkpoints every one of this node's `local_ranks` processes marked as saved: dir name (`checkpoint-N`)
    -> the absolute path the markers hold."""
    saved = control_dir / SAVED_DIR
    if not saved.is_dir():
        return {}
    paths: dict[str, Path] = {}
    ranks: dict[str, set[str]] = {}
    for marker in sorted(saved.iterdir()):
        if marker.name.startswith(".") or not marker.is_file():
            continue
        name, _, rank = marker.name.rpartition("@")
        try:
            text = marker.read_text().strip()
        except OSError:  # removed meanwhile
            continue
        if name and text:
            paths[name] = Path(text)
            ranks.setdefault(name, set()).add(rank)
    return {name: path for name, path in paths.items() if len(ranks[name]) >= local_ranks}


def child_env(env: dict[str, str], control_dir: Path) -> dict[str, str]:
    """`env` for a script child that reports through its Trainer: `SITE_DIR` first on PYTHONPATH, and the control
    directory (made here) in `SHUNTER_SCRIPT_CONTROL`."""
    control_dir.mkdir(parents=True, exist_ok=True)
    out = dict(env)
    out[ENV_SCRIPT_CONTROL] = str(control_dir)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE_DIR), env.get("PYTHONPATH")) if p)
    return out
