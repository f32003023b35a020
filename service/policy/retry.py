"""Retry policy: after an attempt ends, run again (when, from what) or stop. Pure; table-driven tests cover it. What
each end reason is (retryable, free when) is its row of `service.policy.end_reasons`; the conditions are here."""

from __future__ import annotations

from dataclasses import dataclass

from service.core.enums import EndReason
from service.policy import end_reasons
from service.policy.end_reasons import Free


@dataclass(frozen=True)
class RetryDecision:
    retry: bool
    delay_seconds: float = 0.0
    why: str = ""
    uncounted: bool = False  # not a failure: does not use up max_attempts (counted in the job's `preemptions`)


def decide(
    *,
    reason: EndReason,
    attempt: int,
    max_attempts: int,
    backoff_seconds: float,
    max_backoff_seconds: float,
    retry_on_timeout: bool = False,
    preemptions: int = 0,
    cluster_restarts: int = 0,
    count_cluster_restarts: bool = False,
    drain_confirmed: bool = True,
    elastic: bool = False,
    node_losses: int = 0,
    max_free_node_losses: int = 20,
    max_free_retries: int = 100,
) -> RetryDecision:
    """Retry a retryable end while attempts remain, after exponential backoff (doubling, capped).

    A deterministic failure (the user's code raised, a timeout, a cancel) is not retried: running the same code on the
    same data again fails the same way and only burns the cluster.

    `drain_confirmed`: whether Ray showed a node the attempt's end names draining or gone since the attempt started
    (service.dispatch.nodes). A `node_draining` end is claimed from the job's own side (its driver, with the attempt's
    token); one Ray does not bear out is retried as a counted failure, so a job cannot buy itself endless free retries
    by saying its node drains. `elastic`: the job runs at any size in a range; a node it lost (borne out the same way)
    makes it shrink onto the nodes that stay, at once and not counted, rather than fail. `node_losses`: the job's
    earlier attempts that ended so (drained or lost a node); past `max_free_node_losses` they count like any failure,
    so a job that can take its own node down cannot be retried without end. `max_free_retries`: the most attempts of
    one job that do not count, of every kind (preempted, drained, shrunk, a head restart); past it an end of those
    kinds counts like any failure, so no job runs for ever on retries that cost it nothing.
    """
    free = preemptions + (0 if count_cluster_restarts else cluster_restarts)
    free_left = free < max_free_retries
    drain_confirmed = drain_confirmed and node_losses < max_free_node_losses and free_left
    if reason is EndReason.SUCCEEDED:
        return RetryDecision(False, why="succeeded")
    kind = end_reasons.of(reason).free
    if kind is Free.PREEMPTED and free_left:
        return RetryDecision(True, why="preempted: back to the queue, resuming from its checkpoint", uncounted=True)
    if kind is Free.CONFIRMED_NODE and drain_confirmed:
        return RetryDecision(True, why="a node of the attempt is draining: it checkpointed and stopped; back to the "
                             "queue at once to resume on the nodes that stay; this does not count against "
                             "max_attempts", uncounted=True)  # fmt: skip
    if kind is Free.ELASTIC_NODE and elastic and drain_confirmed:
        why = ("an elastic job lost a node: it resumes at once on the nodes that stay, at the size that fits; this "
               "does not count against max_attempts")  # fmt: skip
        return RetryDecision(True, why=why, uncounted=True)
    if kind is Free.HEAD_RESTART and not count_cluster_restarts and free_left:
        delay = min(backoff_seconds, max_backoff_seconds)
        return RetryDecision(True, delay_seconds=delay, why="the Ray head restarted and lost the attempt: resuming "
                             "from its checkpoint; this does not count against max_attempts")  # fmt: skip
    # Preempted attempts (for another job, or on a drain notice) were not failures, nor (unless counted) those a head
    # restart took: they do not use up max_attempts. Past the free ones, a free kind counts like any failure.
    attempt -= min(free, max_free_retries)
    if not end_reasons.retryable(reason, opted_in=frozenset({"retry_on_timeout"} if retry_on_timeout else ())):
        return RetryDecision(False, why=f"{reason.value} is not retryable")
    if attempt >= max_attempts:
        spent = f"; {free} free retries spent (max_free_retries {max_free_retries})" if not free_left else ""
        return RetryDecision(False, why=f"attempts exhausted ({attempt}/{max_attempts}){spent}")
    delay = min(backoff_seconds * (2 ** (attempt - 1)), max_backoff_seconds)
    return RetryDecision(True, delay_seconds=delay, why=f"{reason.value}: attempt {attempt + 1}/{max_attempts}")
