"""The Train callback that carries every `ray.train.report` into shunter's database.

It runs in the Ray Train controller (one process per run), after all ranks reported: rank 0's metrics become the
job's progress and metric series, and each persisted checkpoint a `Checkpoint` row. A database hiccup is logged and
skipped: losing one progress point must never fail a training run.

It also checks that the train loop applied the strategy the spec asked for. A plain Ray Train loop that never calls
`workers.strategies.prepare` runs as it is written (DDP with `ray.train.torch.prepare_model`) whatever `strategy.kind`
says; reports made through a `Prepared` carry the strategy it applied (`workers.context.STRATEGY_METRIC`), so the
first report tells, and a job asking for FSDP or DeepSpeed whose first report lacks it gets a warning. The driver
covers a successful run that never reported at all (`warn_if_never_reported`).
"""

from __future__ import annotations

import logging
from typing import Any

from ray.train import Checkpoint, UserCallback

from workers.context import STRATEGY_METRIC

log = logging.getLogger(__name__)
STRATEGY_NOT_APPLIED = "strategy_not_applied"  # the warning's code (its event's reason)


class ProgressCallback(UserCallback):
    def __init__(
        self, *, database_url: str, job_id: str, attempt: int, keep: int | None = None, strategy: str | None = None
    ) -> None:
        self.database_url = database_url
        self.job_id = job_id
        self.attempt = attempt
        self.keep = keep  # None: the spec's `checkpoint.keep`, read in the controller (SHUNTER_JOB_SPEC is set there)
        self.strategy = strategy  # the strategy kind the loop must apply itself (fsdp, deepspeed); None: no check
        self._reports = 0

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Checkpoint | None) -> None:
        from service.progress import engine_for, record_report

        self._reports += 1
        rank0 = dict(metrics[0]) if metrics else {}
        applied = rank0.pop(STRATEGY_METRIC, None)  # shunter's marker, not a metric of the job
        if self._reports == 1 and self.strategy and applied != self.strategy:
            warn_strategy_not_applied(
                self.database_url, job_id=self.job_id, attempt=self.attempt, expected=self.strategy, applied=applied
            )
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


def strategy_not_applied(expected: str, applied: str | None = None) -> str:
    """The warning for a job whose train loop did not apply the strategy its spec asked for."""
    why = (
        f"its loop prepared itself for {applied}"
        if applied
        else "it never reported through a Prepared from workers.strategies.prepare"
    )
    return (
        f"strategy.kind is {expected}, but the train loop did not apply it ({why}), so it ran as written "
        f"(plain DDP for a loop using ray.train.torch.prepare_model). Call workers.strategies.prepare in the loop "
        f"(or use entrypoint.script for a script that applies its own strategy)."
    )


def warn_strategy_not_applied(
    database_url: str | None, *, job_id: str, attempt: int, expected: str, applied: str | None = None
) -> None:
    """Log the warning and record it on the job (once per attempt); a database hiccup is logged, never raised."""
    message = strategy_not_applied(expected, applied)
    log.warning("shunter: job %s: %s", job_id, message)
    if not database_url:
        return
    from service.progress import engine_for, record_warning

    try:
        record_warning(
            engine_for(database_url), job_id=job_id, attempt=attempt, code=STRATEGY_NOT_APPLIED, message=message
        )
    except Exception:  # noqa: BLE001 - see module docstring
        log.exception("shunter: could not record a warning for job %s", job_id)


def warn_if_never_reported(database_url: str, *, job_id: str, attempt: int, expected: str) -> None:
    """At the end of a successful run: one that never reported gave the callback nothing to check, so nothing shows
    that its loop applied the strategy (a report through a `Prepared` always stores step, epoch and lr)."""
    from service.progress import attempt_reported, engine_for

    try:
        if attempt_reported(engine_for(database_url), job_id=job_id, attempt=attempt):
            return  # the callback checked the first report
    except Exception:  # noqa: BLE001 - see module docstring
        log.exception("shunter: could not read the reports of job %s", job_id)
        return
    warn_strategy_not_applied(database_url, job_id=job_id, attempt=attempt, expected=expected)


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
