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
    def __init__(self, *, database_url: str, job_id: str, attempt: int, keep: int | None = None) -> None:
        self.database_url = database_url
        self.job_id = job_id
        self.attempt = attempt
        self.keep = keep  # None: the spec's `checkpoint.keep`, read in the controller (SHUNTER_JOB_SPEC is set there)
        self._reports = 0

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Checkpoint | None) -> None:
        from service.progress import engine_for, record_report

        self._reports += 1
        rank0 = dict(metrics[0]) if metrics else {}
        uri = _checkpoint_uri(checkpoint) if checkpoint is not None else None
        try:
            complete = _checkpoint_complete(checkpoint) if checkpoint is not None else True
            record_report(
                engine_for(self.database_url),
                job_id=self.job_id,
                attempt=self.attempt,
                metrics=rank0,
                checkpoint_uri=uri,
                checkpoint_complete=complete,
                keep=self._keep(),
                report_index=self._reports,
            )
        except Exception:  # noqa: BLE001 - see module docstring
            log.exception("shunter: could not record report %d of job %s", self._reports, self.job_id)

    def _keep(self) -> int | None:
        if self.keep is not None:
            return self.keep
        from workers.context import job_spec

        return job_spec().checkpoint.keep


def _checkpoint_complete(checkpoint: Checkpoint) -> bool:
    from workers.storage import checkpoint_complete

    try:
        return checkpoint_complete(checkpoint)
    except Exception:  # noqa: BLE001 - storage unreachable: record the row, but never as the one to resume from
        log.exception("shunter: could not check checkpoint %s", checkpoint.path)
        return False


def _checkpoint_uri(checkpoint: Checkpoint) -> str:
    """`s3://bucket/key` for an S3 checkpoint (Ray keeps the path without its scheme), the path for a local one."""
    from workers.storage import uri_of

    return uri_of(checkpoint.path, checkpoint.filesystem)
