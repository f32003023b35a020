"""The Train callback that carries every `ray.train.report` to shunter.

It runs in the Ray Train controller (one process per run), after all ranks reported: rank 0's metrics become the
job's progress and metric series, and each persisted checkpoint a `Checkpoint` row. They go to the internal API with
the attempt's own token (`workers.attempt_api`), never to the database directly. A report the API could not take
because it was down or restarting is tried again for a moment, then kept (the newest `OUTBOX` of them, checkpoint
reports first) and sent before the next one; the driver sends the run's final report itself once `fit()` returns.
Before its first step, a train loop resumed by Ray Train says which checkpoint it restored (`report_restored`), so a
checkpoint whose report was lost with a killed controller is listed all the same.
A refusal is logged and skipped: losing one progress point must never fail a training run.

It also checks that the train loop applied the strategy the spec asked for. A plain Ray Train loop that never calls
`workers.strategies.prepare` runs as it is written (DDP with `ray.train.torch.prepare_model`) whatever `strategy.kind`
says; reports made through a `Prepared` carry the strategy it applied (`workers.context.STRATEGY_METRIC`), so the
first report tells, and a job asking for FSDP or DeepSpeed whose first report lacks it gets a warning. The driver
covers a successful run that never reported at all (`warn_if_never_reported`).
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any, TypeGuard

from ray.train import Checkpoint, UserCallback

from workers.attempt_api import AttemptApi
from workers.context import FINISHED_METRIC, STRATEGY_METRIC

log = logging.getLogger(__name__)
REPORT_PATIENCE_SECONDS = 2.0  # how long one report may wait for the API to come back (the loop waits with it)
OUTBOX = 200  # reports kept while the API is away
STRATEGY_NOT_APPLIED = "strategy_not_applied"  # the warning's code (its event's reason)


class ProgressCallback(UserCallback):
    def __init__(self, *, api: AttemptApi, keep: int | None = None, strategy: str | None = None) -> None:
        self.api = api  # strings only: the callback is pickled into the controller, which makes its own client
        self.job_id = api.job_id
        self.attempt = api.attempt
        self.keep = keep  # None: the spec's `checkpoint.keep`, read in the controller (from the API)
        self.strategy = strategy  # the strategy kind the loop must apply itself (fsdp, deepspeed); None: no check
        self._reports = 0
        self._outbox: list[dict[str, Any]] = []  # report bodies the API could not take yet, oldest first

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Checkpoint | None) -> None:
        rank0 = dict(metrics[0]) if metrics else {}
        if FINISHED_METRIC in rank0:
            self._finished()
            return
        self._reports += 1
        applied = rank0.pop(STRATEGY_METRIC, None)  # shunter's marker, not a metric of the job
        if self._reports == 1 and self.strategy and applied != self.strategy:
            warn_strategy_not_applied(self.api, job_id=self.job_id, expected=self.strategy, applied=applied)
        uri = checkpoint_uri_of(checkpoint) if checkpoint is not None else None
        try:
            complete, sealed = checkpoint_seal(checkpoint) if checkpoint is not None else (True, None)
            step = rank0.get("step")
            numeric = isinstance(step, int | float) and not isinstance(step, bool) and math.isfinite(step)
            step = int(step) if numeric and step is not None else self._reports
            body = self.api.report_body(rank0, step=step, checkpoint_uri=uri, checkpoint_complete=complete,
                                        keep=self._keep(), manifest_sha256=sealed)  # fmt: skip
        except Exception:  # noqa: BLE001 - see module docstring
            log.exception("shunter: could not read report %d of job %s", self._reports, self.job_id)
            return
        self._outbox.append(body)
        self._deliver()

    def _finished(self) -> None:
        """Every rank's train loop has returned (`announce_finished`), and Ray Train handed over every report the loop
        made before this one: record the attempt's success now. The driver would only say it once `fit()` returns,
        after Ray Train's teardown of the worker group, which can take seconds (12 s on Ray 2.60 here). Reports the
        API could not take yet go first; while any is still kept, the success is left to the driver, which sends the
        run's final report before its own word, so the job never succeeds without its last checkpoint."""
        self._deliver()
        if self._outbox:
            log.warning("shunter: job %s: reports still kept at the end of training: the driver records the end",
                        self.job_id)  # fmt: skip
            return
        if self.strategy and self._reports == 0:  # no report to check the strategy on (the driver's check, earlier)
            warn_strategy_not_applied(self.api, job_id=self.job_id, expected=self.strategy)
        from service.core.enums import EndReason

        try:
            self.api.end(EndReason.SUCCEEDED.value, SUCCEEDED_MESSAGE, patience=REPORT_PATIENCE_SECONDS)
        except Exception:  # noqa: BLE001 - the driver records the end once fit() returns
            log.exception("shunter: could not record the end of job %s at the end of training", self.job_id)

    def _deliver(self) -> None:
        """Send what the outbox holds, oldest first; stop at the first transient failure and keep the rest."""
        from workers.attempt_api import transient

        while self._outbox:
            body = self._outbox[0]
            try:
                self.api.send_report(body, patience=REPORT_PATIENCE_SECONDS if len(self._outbox) == 1 else 0.0)
            except Exception as exc:  # noqa: BLE001 - see module docstring
                if transient(exc):
                    log.warning("shunter: API unavailable, %d report(s) of job %s kept: %s", len(self._outbox),
                                self.job_id, exc)  # fmt: skip
                    self._trim()
                    return
                log.exception("shunter: report of job %s refused", self.job_id)
            self._outbox.pop(0)

    def _trim(self) -> None:
        """Bound the outbox: drop the oldest reports without a checkpoint first."""
        while len(self._outbox) > OUTBOX:
            plain = next((i for i, b in enumerate(self._outbox) if not b.get("checkpoint_uri")), 0)
            self._outbox.pop(plain)

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
    api: AttemptApi | None, *, job_id: str, expected: str, applied: str | None = None
) -> None:
    """Log the warning and record it on the job (once per attempt); a failed write is logged, never raised."""
    message = strategy_not_applied(expected, applied)
    log.warning("shunter: job %s: %s", job_id, message)
    if api is None:
        return
    try:
        api.warning(STRATEGY_NOT_APPLIED, message)
    except Exception:  # noqa: BLE001 - see module docstring
        log.exception("shunter: could not record a warning for job %s", job_id)


def warn_if_never_reported(api: AttemptApi, *, expected: str) -> None:
    """At the end of a successful run: one that never reported gave the callback nothing to check, so nothing shows
    that its loop applied the strategy (a report through a `Prepared` always stores step, epoch and lr)."""
    try:
        if api.reported():
            return  # the callback checked the first report
    except Exception:  # noqa: BLE001 - see module docstring
        log.exception("shunter: could not read the reports of job %s", api.job_id)
        return
    warn_strategy_not_applied(api, job_id=api.job_id, expected=expected)


def checkpoint_seal(checkpoint: Checkpoint) -> tuple[bool, str | None]:
    """(complete, the sha256 of its manifest as read now, None without one) of a checkpoint this attempt reports:
    the one rule (`workers.manifest.check`), and what the service keeps to prove it by at a resume (workers.proof)."""
    from workers import manifest

    try:
        verdict = manifest.check(checkpoint.path, checkpoint.filesystem)
    except Exception:  # noqa: BLE001 - storage unreachable: record the row, but never as the one to resume from
        log.exception("shunter: could not check checkpoint %s", checkpoint.path)
        return False, None
    if not verdict.complete:
        log.warning("checkpoint incomplete: %s", verdict.reason)
    return verdict.complete, verdict.manifest_sha256


def checkpoint_uri_of(checkpoint: Checkpoint) -> str:
    """`s3://bucket/key` for an S3 checkpoint (Ray keeps the path without its scheme), the path for a local one."""
    from workers.storage import uri_of

    return uri_of(checkpoint.path, checkpoint.filesystem)


SUCCEEDED_MESSAGE = "succeeded"


def announce_finished() -> None:
    """Every rank, once its train loop has returned: a report of shunter's own (`FINISHED_METRIC`), the last of the
    run. Ray Train consolidates a report only when every rank has made it, and hands reports to the controller's
    callbacks in order, so `ProgressCallback` sees it after the loop's every report and only once all ranks are done:
    that is when the attempt succeeds (`ProgressCallback._finished`)."""
    import ray.train

    from workers.attempt_api import sent_in_background

    sent_in_background(timeout=STARTED_PATIENCE_SECONDS)  # rank 0's news first: an end would fence it off
    ray.train.report({FINISHED_METRIC: 1})


STARTED_PATIENCE_SECONDS = 10.0  # how long the start of training waits for an API that is restarting


def announce_started(*, barrier: bool = True) -> None:
    """Every rank: wait until all ranks got here (a Ray Train barrier, unless the caller knows they all started: the
    pre-flight check's collectives passed), then rank 0 tells shunter the attempt's ranks have all started, which
    makes the job RUNNING before its first report; it is sent from a thread of its own, so the loop starts at once.
    Never raises for shunter's part."""
    import ray.train

    if barrier:
        from ray.train.collective import barrier as every_rank

        every_rank()
    if ray.train.get_context().get_world_rank() != 0:
        return
    from workers.attempt_api import in_background
    from workers.context import attempt_api

    api = attempt_api()
    if api is not None:  # the first step does not wait for the API; if it is lost, RUNNING comes with the first report
        in_background(api, lambda a: a.started(patience=STARTED_PATIENCE_SECONDS), "that its ranks started")


RESTORE_PATIENCE_SECONDS = 30.0  # the first step waits at most this long for an API that is restarting


def report_restored() -> None:
    """On rank 0, before the train loop's first step: tell shunter which checkpoint Ray Train restored for this run
    (`ray.train.get_checkpoint()`), with its step and writing attempt from shunter's manifest when it has one.

    Ray Train resumes a run from its own record of checkpoints; a checkpoint whose report to shunter was lost (the
    Train controller killed with a Ray head, its outbox with it) would otherwise be the one the job goes on from and
    missing from its list. Never raises: progress is news, not a reason to fail training."""
    try:
        import ray.train

        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None or ray.train.get_context().get_world_rank() != 0:
            return
        from workers.context import attempt_api

        api = attempt_api()
        if api is None:
            return
        from workers import manifest

        verdict = manifest.check(checkpoint.path, checkpoint.filesystem)
        sealed = verdict.manifest or {}
        step = sealed.get("step")
        if not _whole(step):
            step = ray_record_of(checkpoint).get("step")
        writer = sealed.get("attempt")
        api.restored(
            checkpoint_uri_of(checkpoint), complete=verdict.complete,
            step=int(step) if _whole(step) else None,
            written_by=int(writer) if _whole(writer) and writer >= 1 else None,
            patience=RESTORE_PATIENCE_SECONDS,
        )  # fmt: skip
    except Exception:  # noqa: BLE001 - see the docstring
        log.exception("shunter: could not report the checkpoint this attempt resumed from")


def _whole(value: Any) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0 \
        and int(value) == value  # fmt: skip


RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train V2's record of a run's checkpoints, beside them


def ray_record_of(checkpoint: Checkpoint) -> dict[str, Any]:
    """The metrics Ray Train recorded with `checkpoint` (rank 0's report), from its run's checkpoint record in
    storage; {} when that record is missing or not as expected (its format is Ray's own, read defensively: only the
    checkpoint's step is taken from it, for a checkpoint without shunter's manifest)."""
    import posixpath

    try:
        fs = checkpoint.filesystem
        if fs is None:
            return {}
        with fs.open_input_stream(posixpath.join(posixpath.dirname(checkpoint.path), RAY_SNAPSHOT)) as stream:
            record = json.loads(stream.read())
        name = posixpath.basename(checkpoint.path.rstrip("/"))
        for entry in [record.get("latest_checkpoint_result"), *record.get("checkpoint_results", [])]:
            if isinstance(entry, dict) and entry.get("checkpoint_dir_name") == name:
                metrics = entry.get("metrics")
                return dict(metrics) if isinstance(metrics, dict) else {}
    except Exception:  # noqa: BLE001 - see the docstring
        log.debug("no Ray Train record for %s", checkpoint.path, exc_info=True)
    return {}
