"""The driver's failure classes, from the exception types Ray Train raises (no cluster needed)."""

from __future__ import annotations

import pytest
from ray.train import WorkerGroupError
from ray.train.v2._internal.exceptions import (
    CollectiveTimeoutError,
    UserExceptionWithTraceback,
    WorkerHealthCheckFailedError,
)
from ray.train.v2.api.exceptions import PreemptionError
from ray.train.v2.api.preemption import PreemptionInfo

from service.store.models import EndReason
from workers.driver import classify_failure
from workers.script import ScriptKilledError

GENERIC_DEATH = (
    "The actor is dead because its worker process has died. Some common causes include: (1) the process was killed "
    "by the OOM killer due to high memory usage"
)


def group(*errors: Exception) -> WorkerGroupError:
    return WorkerGroupError("Training failed due to worker errors", dict(enumerate(errors)))


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (group(UserExceptionWithTraceback(RuntimeError("boom"), "tb")), EndReason.USER_ERROR),
        (group(RuntimeError("injected failure at step 5")), EndReason.USER_ERROR),
        # Script mode: a script killed from outside (OOM killer, operator) lost its worker; its own exit or crash
        # is its error.
        (group(UserExceptionWithTraceback(ScriptKilledError("script x.py was killed by SIGKILL on rank 1"), "tb")),
         EndReason.WORKER_LOST),
        (group(UserExceptionWithTraceback(RuntimeError("script x.py exited with code -11 on rank 1"), "tb")),
         EndReason.USER_ERROR),
        (group(UserExceptionWithTraceback(RuntimeError("script x.py exited with code 3 on rank 0"), "tb")),
         EndReason.USER_ERROR),
        # A surviving rank's view of a dead peer (seen on a node loss under load, before Ray reported the worker).
        (group(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:25286. This is "
                            "typically caused by a remote worker crashing.")), EndReason.WORKER_LOST),
        (group(WorkerHealthCheckFailedError("A worker health check failed.", RuntimeError(GENERIC_DEATH))),
         EndReason.WORKER_LOST),
        (group(RuntimeError(GENERIC_DEATH)), EndReason.WORKER_LOST),  # "OOM killer" in the hint is not an OOM
        (group(RuntimeError("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB")),
         EndReason.OUT_OF_MEMORY),
        (group(RuntimeError("Task was killed due to the node running low on memory.")), EndReason.OUT_OF_MEMORY),
        (group(CollectiveTimeoutError("collective timed out")), EndReason.COLLECTIVE_TIMEOUT),
        (group(RuntimeError("Watchdog caught collective operation timeout: NCCL")), EndReason.COLLECTIVE_TIMEOUT),
        (group(RuntimeError("The actor died because its node has died. Node Id: ab")), EndReason.NODE_LOST),
        # A drain deadline that passed before the loop checkpointed (one that never asks): Ray Train's own error.
        (PreemptionError(PreemptionInfo(deadline_ms=1, preempted_node_to_ranks={"ab": [1]}), drain_timed_out=True),
         EndReason.NODE_DRAINING),
    ],
)  # fmt: skip
def test_classify(exc: BaseException, reason: EndReason) -> None:
    assert classify_failure(exc) is reason


def test_a_raylet_that_takes_a_connection_is_alive_and_one_that_refuses_is_not() -> None:
    """`dead_worker_nodes` stops waiting for Ray's verdict as soon as every node's raylet answers (a lost worker,
    not a lost node); a raylet killed with its node refuses, and a node entry without an address is not alive."""
    import socket

    from workers.driver import raylet_answers

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        assert raylet_answers({"NodeManagerAddress": "127.0.0.1", "NodeManagerPort": port})
    assert not raylet_answers({"NodeManagerAddress": "127.0.0.1", "NodeManagerPort": port})  # closed: refused
    assert not raylet_answers({"NodeID": "n1"})
