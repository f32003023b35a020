"""The Ray Job entrypoint of one attempt: `python -m workers.driver`.

It reads its job from the environment the dispatcher set and its spec from the API (`workers.context`), builds a
`TorchTrainer` from the spec, runs it, and records why the attempt ended (through the API) before exiting (0 on
success, 1 otherwise), so the dispatcher need not guess from Ray's status alone. It also records a warning when the
spec asked for FSDP or DeepSpeed and the train loop never applied it (see `workers.progress`).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from typing import TYPE_CHECKING

from service.core.enums import EndReason
from service.spec.strategy import StrategyKind
from workers import context
from workers.drain import drained_value

if TYPE_CHECKING:
    from service.spec.job import JobSpec
    from workers.attempt_api import AttemptApi

log = logging.getLogger("shunter.driver")


def classify_failure(exc: BaseException) -> EndReason:
    """Name why training failed, from the exceptions Ray Train raised (the workers' own ones first).

    Types decide before text, and text patterns stay narrow: Ray's generic "worker died" message mentions the OOM
    killer as one possible cause, which must not turn every lost worker into an out-of-memory failure.
    """
    failures = list((getattr(exc, "worker_failures", None) or {}).values()) or [exc]
    # Ray Train wraps a train loop's own exception (UserExceptionWithTraceback): its type is the one that tells.
    names = {type(getattr(e, "_base_exc", e)).__name__ for e in failures} | {type(e).__name__ for e in failures}
    names |= {type(exc).__name__}
    text = " ".join(f"{type(e).__name__}: {e}" for e in [exc, *failures])
    lowered = text.lower()
    if "StorageTampered" in names:  # its code or checkpoint is not what the service recorded (workers.proof)
        return EndReason.STORAGE_TAMPERED
    if "PreflightFailed" in names:  # a rank failed the check before training (workers.preflight): it names the node
        return EndReason.PREFLIGHT_FAILED
    if "PreemptionError" in names:  # a node's drain deadline passed before the loop checkpointed and stopped
        return EndReason.NODE_DRAINING
    if "OutOfMemoryError" in names or "cuda out of memory" in lowered or "running low on memory" in lowered:
        return EndReason.OUT_OF_MEMORY
    if names & {"NCCLHangError", "CollectiveTimeoutError", "BroadcastCollectiveTimeoutError"} or (
        "collective operation timeout" in lowered
        or (("nccl" in lowered or "gloo" in lowered) and "timed out" in lowered)
    ):
        return EndReason.COLLECTIVE_TIMEOUT
    if "NodeDiedError" in names or "its node has died" in lowered or "node was terminated" in lowered:
        return EndReason.NODE_LOST
    health = {"WorkerHealthCheckFailedError", "WorkerHealthCheckTimeoutError"}
    lost = {"ActorDiedError", "WorkerCrashedError", "ActorUnavailableError", "ScriptKilledError"} | health
    # A surviving rank's collective fails first when a peer dies (gloo: "Connection closed by peer ... typically caused
    # by a remote worker crashing"); under load that arrives before Ray's own report of the dead worker.
    peer_gone = any(p in lowered for p in ("connection closed by peer", "connection reset by peer",
                                           "remote worker crashing", "remote process exited"))  # fmt: skip
    if names & lost or peer_gone or "worker process has died" in lowered or "health check failed" in lowered:
        return EndReason.NODE_LOST if _named_node_is_dead(text) else EndReason.WORKER_LOST
    if names & {"WorkerGroupStartupTimeoutError", "InsufficientClusterResourcesError"}:
        return EndReason.NO_RESOURCES
    if "ControllerError" in names:
        return EndReason.INFRA
    return EndReason.USER_ERROR


def _named_node_is_dead(text: str) -> bool:
    """Whether a node named in the failure (`node_id='…'`) is gone from the cluster: a lost node, not a lost worker."""
    import re

    node_ids = set(re.findall(r"node_id='([0-9a-f]{16,})'", text))
    if not node_ids:
        return False
    try:
        import ray

        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    except Exception:  # noqa: BLE001 - without Ray's view, say only what is certain: a worker was lost
        return False
    return bool(node_ids - alive)


def dead_worker_nodes(wait_seconds: float = 15.0) -> list[str]:
    """Nodes of this run's train workers that Ray shows dead, waiting a little for it to notice (a node's loss reaches
    the GCS after the surviving ranks' collectives have already failed: Ray marks a node dead only once its health
    checks have failed for seconds). It waits only while a node's raylet does not answer: when every node's raylet
    still takes a connection, a worker was lost and not its node, and that is known at once (it used to wait out
    `wait_seconds` on every lost worker, holding the attempt's end and so its retry)."""
    import time

    import ray
    from ray.util.state import list_actors

    try:
        job = ray.get_runtime_context().get_job_id()
        actors = list_actors(filters=[("job_id", "=", job)], limit=10_000, raise_on_missing_output=False)
        nodes = {a.node_id for a in actors if "RayTrainWorker" in (a.class_name or "") and a.node_id}
    except Exception:  # noqa: BLE001 - without Ray's state API, say only what is certain: a worker was lost
        return []
    deadline = time.monotonic() + wait_seconds
    while True:
        try:
            alive = {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}
        except Exception:  # noqa: BLE001 - as above
            return []
        if nodes - alive.keys() or time.monotonic() >= deadline:
            return sorted(nodes - alive.keys())
        if all(raylet_answers(alive[node]) for node in nodes):
            return []
        time.sleep(0.5)


def raylet_answers(node: dict, timeout: float = 1.0) -> bool:
    """Whether the raylet of `node` (an entry of `ray.nodes()`) takes a TCP connection: a node whose raylet was killed
    refuses at once, one cut off from the network times out; neither is taken for alive."""
    import socket

    try:
        with socket.create_connection((node["NodeManagerAddress"], int(node["NodeManagerPort"])), timeout=timeout):
            return True
    except (OSError, KeyError, TypeError, ValueError):
        return False


def build_trainer(spec, *, job_id: str, attempt: int, storage: str, api: AttemptApi | None):  # noqa: ANN001, ANN201
    """The TorchTrainer for this attempt (imports torch and Ray Train: worker side only)."""
    # Train V2's: what ray.train names when V2 is on, as it is for every attempt (service.tenancy.modes)
    from ray.train import UserCallback
    from ray.train.v2.api.config import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig

    from workers.lean_trainer import trainer_class
    from workers.progress import ProgressCallback
    from workers.storage import filesystem_for
    from workers.torch_config import torch_config
    from workers.train_loop import train_loop_for

    res = spec.resources
    per_worker = res.per_worker()
    scaling = ScalingConfig(
        num_workers=context.world_size(res),  # the size admission gave the attempt (elastic: within its range)
        use_gpu=res.use_gpu,
        resources_per_worker=per_worker,
        placement_strategy=res.placement.ray_strategy,
        label_selector=excluded_nodes_selector(os.environ.get(EXCLUDED_NODES_ENV, "")),
    )
    expected = strategy_to_check(spec)
    callbacks: list[UserCallback] = (
        [ProgressCallback(api=api, keep=spec.checkpoint.keep, strategy=expected.value if expected else None)]
        if api is not None
        else []
    )
    storage_path, filesystem = filesystem_for(storage)
    run_name = run_name_for(spec, job_id=job_id, attempt=attempt)
    run_config = RunConfig(
        name=run_name,
        storage_path=storage_path,
        storage_filesystem=filesystem,
        checkpoint_config=CheckpointConfig(num_to_keep=spec.checkpoint.keep),
        # A drain notice is shunter's to act on (workers.drain), and a deadline that passes first ends the attempt
        # (PreemptionError: node_draining) for the dispatcher to retry through admission, not Ray in place.
        failure_config=FailureConfig(max_failures=spec.retries.max_worker_failures, max_preemption_failures=0),
        callbacks=callbacks,
    )
    train_loop, loop_config = train_loop_for(spec)
    return trainer_class()(
        train_loop,
        train_loop_config=loop_config,
        scaling_config=scaling,
        run_config=run_config,
        torch_config=torch_config("nccl" if res.use_gpu else "gloo"),
    )


EXCLUDED_NODES_ENV = (
    "SHUNTER_EXCLUDED_NODES"  # service.dispatch.submission sets it: the nodes admission kept this attempt off
)


def excluded_nodes_selector(nodes: str) -> dict[str, str] | None:
    """Ray's label selector that keeps every worker off these nodes (`ray.io/node-id`, Ray's own label of each node);
    None when there are none. Node ids are hex: anything else in the list is dropped, not passed to Ray."""
    ids = [n for n in (p.strip() for p in nodes.split(",")) if n and all(c in "0123456789abcdef" for c in n)]
    return {"ray.io/node-id": f"!in({','.join(ids)})"} if ids else None


def strategy_to_check(spec: JobSpec) -> StrategyKind | None:
    """The strategy the train loop must apply itself, when shunter is to check that it did: FSDP or DeepSpeed.

    DDP is what a plain Ray Train loop runs anyway; script mode (`entrypoint.script`) applies its own strategy.
    """
    if spec.entrypoint.script or spec.strategy.kind is StrategyKind.ddp:
        return None
    return spec.strategy.kind


def run_name_for(spec, *, job_id: str, attempt: int) -> str:  # noqa: ANN001
    """The Ray Train run name for `checkpoint.resume_from`.

    latest: every attempt reuses `<job id>`, so Ray Train restores the run's own checkpoint record and
    `get_checkpoint()` returns its newest checkpoint, whichever earlier attempt wrote it. none, or an explicit
    checkpoint id: a fresh run per attempt; for an id, the dispatcher puts its URI in SHUNTER_RESUME_FROM, where
    `workers.checkpoint` loads it from (Train V2 refuses `TorchTrainer(resume_from_checkpoint=...)`).
    """
    return job_id if spec.checkpoint.resume_from == "latest" else f"{job_id}-attempt{attempt}"


TIMING: dict[str, float] = {}  # when this driver reached each step of its start (epoch seconds): logged at fit()


def process_started_at() -> float:
    """When this process was created (the interpreter's own start-up included)."""
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:  # noqa: BLE001 - a timing only
        return time.time()


def verify_code(api: AttemptApi | None) -> tuple[EndReason, str] | None:
    """The working directory Ray unpacked checked against the code archive the service recorded (`workers.proof`),
    before this driver looks at anything of the job's (its spec, its modules); on a mismatch the attempt's end,
    recorded, and nothing of the job runs."""
    from workers.proof import StorageTampered
    from workers.proof import verify_code as verify

    try:
        checked = verify(api)
    except StorageTampered as exc:
        message = f"{type(exc).__name__}: {exc}"
        log.error("%s", message)
        if api is not None:
            _record_end(api, EndReason.STORAGE_TAMPERED, message)
        return EndReason.STORAGE_TAMPERED, message
    if checked:
        log.info("%s", checked)
    return None


def main() -> int:
    TIMING["process_started"] = process_started_at()
    TIMING["driver_imported"] = time.time()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s shunter-driver %(levelname)s %(message)s")
    try:
        context.exchange_bootstrap()  # the attempt token, for the one-use credential Ray's records show
    except Exception as exc:  # noqa: BLE001 - refused: it cannot report, so it must not train
        log.error("could not trade this attempt's bootstrap credential for its token: %s", exc)
        return 1
    if verify_code(context.attempt_api()) is not None:
        return 1
    TIMING["code_verified"] = time.time()
    spec = context.job_spec()
    TIMING["spec_read"] = time.time()
    job_id = context.job_id() or "adhoc"
    attempt = context.attempt()
    storage = os.environ.get(context.ENV_STORAGE) or os.path.abspath("shunter-checkpoints")
    api = context.attempt_api()
    log.info("job %s attempt %d: %d x %s, strategy %s", job_id, attempt, context.world_size(spec.resources),
             spec.resources.per_worker(), spec.strategy.kind.value)  # fmt: skip

    import ray

    ray.init(log_to_driver=True)
    TIMING["ray_connected"] = time.time()
    reason, message = run(spec, job_id=job_id, attempt=attempt, storage=storage, api=api)
    log.info("attempt ended: %s", reason.value)
    return 0 if reason is EndReason.SUCCEEDED else 1


def run(spec: JobSpec, *, job_id: str, attempt: int, storage: str, api: AttemptApi | None) -> tuple[EndReason, str]:
    """Train this attempt to its end (Ray already initialised) and record how it ended; (end reason, message).
    `api`: where to report (None: nowhere, e.g. outside shunter)."""
    from workers.progress import SUCCEEDED_MESSAGE

    reason, message = EndReason.SUCCEEDED, SUCCEEDED_MESSAGE
    try:
        trainer = build_trainer(spec, job_id=job_id, attempt=attempt, storage=storage, api=api)
        TIMING["fit"] = time.time()
        # Where the start of an attempt went, for `bench/orchestration.py`'s breakdown (and anyone reading the log).
        log.info("timing: %s", " ".join(f"{k}={v:.3f}" for k, v in TIMING.items()))
        result = trainer.fit()
        log.info("training finished; final checkpoint: %s", getattr(result.checkpoint, "path", None))
        if api is not None:
            report_final(api, result, keep=spec.checkpoint.keep)
        drained = drained_value(getattr(result, "return_value", None))
        if drained is not None:  # stopped on a drain notice once its checkpoint was written (workers.drain)
            from workers.drain import NodeDraining

            message = str(NodeDraining(drained.get("notice") or {}, drained.get("step")))
            log.info("%s", message)
            reason = EndReason.NODE_DRAINING
            if api is not None:
                _record_end(api, reason, message)
            return reason, message
        expected = strategy_to_check(spec)
        if expected and api is not None:
            # The Train callback checked the first report; this covers a run with none. (A failed run that never
            # reported is left alone: it may have failed inside `prepare` itself, and its failure is the news.)
            from workers.progress import warn_if_never_reported

            warn_if_never_reported(api, expected=expected.value)
        if api is not None:
            # The run's last word, once its final report has landed. The Train callback has normally said it already,
            # as soon as every rank's loop returned (workers.progress.announce_finished), before Ray Train's teardown
            # let fit() return; this one then changes nothing. It counts when the callback could not say it (reports
            # still kept for an API that was away), and is still ahead of Ray calling the Ray Job ended.
            _record_end(api, reason, message)
        return reason, message
    except KeyboardInterrupt:
        reason, message = EndReason.CANCELLED, "stopped by request"
    except Exception as exc:  # noqa: BLE001 - classified, recorded, and printed in full below
        reason = classify_failure(exc)
        message = f"{type(exc).__name__}: {exc}"
        if reason is EndReason.WORKER_LOST:  # a surviving rank often tells first; was it the node that went?
            gone = dead_worker_nodes()
            if gone:
                reason = EndReason.NODE_LOST
                message += f" Lost nodes: {', '.join(gone)}."
        info = getattr(exc, "preemption_info", None)
        if info is not None:  # which nodes: the dispatcher checks the claim against Ray (service.dispatch.nodes)
            message += f" Draining nodes: {', '.join(info.preempted_node_ids)}."
        traceback.print_exc()
    if api is not None and reason is not EndReason.SUCCEEDED:
        _record_end(api, reason, message)
    return reason, message


def _record_end(api: AttemptApi, reason: EndReason, message: str) -> None:
    try:
        api.end(reason.value, message, patience=FINAL_PATIENCE_SECONDS)
    except Exception:  # noqa: BLE001 - the exit code still tells the dispatcher the attempt did not succeed
        log.exception("could not record the end of the attempt")


FINAL_PATIENCE_SECONDS = 60.0  # the last word of an attempt waits this long for an API that is restarting


def report_final(api: AttemptApi, result: object, *, keep: int | None) -> None:
    """The run's last checkpointed report, sent again from the driver, patiently: if the API was away when the Train
    callback sent it (and the controller is gone with its outbox), the job's step and latest checkpoint still land.
    The API takes a report of a checkpoint it already has as a replay (progress only, no second row)."""
    metrics = dict(getattr(result, "metrics", None) or {})
    checkpoint = getattr(result, "checkpoint", None)
    step = metrics.get("step")
    if checkpoint is None or not isinstance(step, int | float) or isinstance(step, bool):
        return  # nothing that says where the run ended, or nothing to tell a replay by
    from workers.context import STRATEGY_METRIC
    from workers.progress import checkpoint_seal, checkpoint_uri_of

    metrics.pop(STRATEGY_METRIC, None)
    uri, (complete, sealed) = checkpoint_uri_of(checkpoint), checkpoint_seal(checkpoint)
    try:
        api.report(metrics, step=int(step), checkpoint_uri=uri, checkpoint_complete=complete, keep=keep,
                   patience=FINAL_PATIENCE_SECONDS, manifest_sha256=sealed)  # fmt: skip
    except Exception:  # noqa: BLE001 - the run succeeded; its last progress point is not worth failing it
        log.exception("could not record the final report")


if __name__ == "__main__":
    sys.exit(main())
