"""The end-reason table (service.policy.end_reasons): each reason's row says what the retry policy, reconcile, the
writes of an end and the driver's API do with it. Pinned here reason by reason, so a changed row is a failing case."""

from __future__ import annotations

import pytest

from service.core.enums import EndReason, EventKind, JobState
from service.lifecycle.state import end_reason_state
from service.policy import end_reasons, retry
from service.policy.end_reasons import Free

R = EndReason
# reason: (retried, free, claimable by its driver, claim confirmed by the cluster, message is the driver's, job ends)
EXPECTED = {
    R.SUCCEEDED: (False, None, True, False, False, JobState.SUCCEEDED),
    R.USER_ERROR: (False, None, True, False, False, JobState.FAILED),
    R.OUT_OF_MEMORY: (True, None, True, False, False, JobState.FAILED),
    R.WORKER_LOST: (True, None, True, False, False, JobState.FAILED),
    R.NODE_LOST: (True, Free.ELASTIC_NODE, True, True, True, JobState.FAILED),
    R.COLLECTIVE_TIMEOUT: (True, None, True, False, False, JobState.FAILED),
    R.NO_RESOURCES: (False, None, True, False, False, JobState.FAILED),
    R.TIMEOUT: (False, None, False, False, False, JobState.FAILED),
    R.CANCELLED: (False, None, True, False, False, JobState.CANCELLED),
    R.PREEMPTED: (True, Free.PREEMPTED, False, False, False, JobState.FAILED),
    R.NODE_DRAINING: (True, Free.CONFIRMED_NODE, True, True, True, JobState.FAILED),
    R.CLUSTER_RESTARTED: (True, Free.HEAD_RESTART, False, False, False, JobState.FAILED),
    R.PREFLIGHT_FAILED: (True, None, True, False, False, JobState.FAILED),
    R.STALLED: (True, None, True, False, True, JobState.FAILED),
    R.DEPENDENCY_FAILED: (False, None, True, False, False, JobState.FAILED),
    R.STORAGE_TAMPERED: (False, None, True, False, False, JobState.FAILED),
    R.INFRA: (True, None, True, False, False, JobState.FAILED),
}


def test_every_end_reason_has_a_row_and_an_expectation() -> None:
    assert set(end_reasons.TABLE) == set(EndReason) == set(EXPECTED)


@pytest.mark.parametrize("reason", list(EndReason), ids=lambda r: r.value)
def test_the_row_of(reason: EndReason) -> None:
    retried, free, claimable, confirm, driver_account, state = EXPECTED[reason]
    assert end_reasons.retryable(reason) is retried
    assert end_reasons.of(reason).free is free
    assert (reason in end_reasons.CLAIMABLE) is claimable
    assert (reason in end_reasons.TO_CONFIRM) is confirm
    assert (reason in end_reasons.DRIVER_ACCOUNT) is driver_account
    assert end_reason_state(reason) is state
    assert (reason in end_reasons.NODE_ENDS) is (reason in {R.NODE_DRAINING, R.NODE_LOST})
    assert end_reasons.of(reason).says


def test_a_timeout_is_retried_only_when_the_spec_opts_in() -> None:
    assert not end_reasons.retryable(R.TIMEOUT)
    assert end_reasons.retryable(R.TIMEOUT, opted_in=frozenset({"retry_on_timeout"}))
    common = {"attempt": 1, "max_attempts": 3, "backoff_seconds": 1.0, "max_backoff_seconds": 8.0}
    assert not retry.decide(reason=R.TIMEOUT, **common).retry
    assert retry.decide(reason=R.TIMEOUT, retry_on_timeout=True, **common).retry


def test_what_a_retry_writes_beside_the_requeue() -> None:
    """The drain's own event, the preemption's message, and the head restart's counter column."""
    assert end_reasons.of(R.NODE_DRAINING).retry_event == (EventKind.DRAIN, "node_draining")
    assert end_reasons.of(R.PREEMPTED).retry_says and end_reasons.of(R.PREEMPTED).retry_event is None
    assert end_reasons.of(R.CLUSTER_RESTARTED).counter == "cluster_restarts"
    assert [r for r, m in end_reasons.TABLE.items() if m.counter] == [R.CLUSTER_RESTARTED]
