"""The Train callback that carries every `ray.train.report` into shunter's database.

It runs in the Ray Train controller (one process per run), after all ranks reported: rank 0's metrics become the
job's progress and metric series, and each persisted checkpoint a `Checkpoint` row. A database hiccup is logged and
skipped: losing one progress point must never fail a training run.
"""

from __future__ import annotations

import logging
from typing import Any

from ray.train import Checkpoint, UserCallback

log = logging.getLogger(__name__)


class ProgressCallback(UserCallback):
    def __init__(self, *, database_url: str, job_id: str, attempt: int) -> None:
        self.database_url = database_url
        self.job_id = job_id
        self.attempt = attempt
        self._reports = 0

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Checkpoint | None) -> None:
        from service.progress import engine_for, record_report

        self._reports += 1
        rank0 = dict(metrics[0]) if metrics else {}
        uri = _checkpoint_uri(checkpoint) if checkpoint is not None else None
        try:
            record_report(
                engine_for(self.database_url),
                job_id=self.job_id,
                attempt=self.attempt,
                metrics=rank0,
                checkpoint_uri=uri,
                report_index=self._reports,
            )
        except Exception:  # noqa: BLE001 - see module docstring
            log.exception("shunter: could not record report %d of job %s", self._reports, self.job_id)


def _checkpoint_uri(checkpoint: Checkpoint) -> str:
    fs = checkpoint.filesystem
    scheme = getattr(fs, "type_name", "local") if fs is not None else "local"
    if scheme in ("local", None):
        return checkpoint.path
    return f"{scheme}://{checkpoint.path}"
