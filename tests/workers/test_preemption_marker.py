"""The dispatcher's preemption marker (workers.preemption) names the attempt it asks."""

from __future__ import annotations

import pytest


def test_a_marker_left_by_an_earlier_attempt_asks_nothing_of_this_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dispatcher's marker names the attempt it asks; a later attempt that finds it (not cleared) trains on."""
    import json

    from workers.preemption import for_this_attempt

    monkeypatch.setenv("SHUNTER_ATTEMPT", "2")
    assert for_this_attempt(json.dumps({"at": "2026-12-02T00:00:00+00:00", "attempt": 2}).encode())
    assert not for_this_attempt(json.dumps({"at": "2026-12-02T00:00:00+00:00", "attempt": 1}).encode())
    assert for_this_attempt(b"2026-12-02T00:00:00+00:00")  # an older service's marker: a bare timestamp
