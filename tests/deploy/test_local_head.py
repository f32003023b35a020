"""`ensure_local_head`, on real `ray start` processes: a head that never becomes ready is stopped, whole, and started
again on fresh ports before the error reaches the caller; one that comes up is re-attached to, not started twice."""

from __future__ import annotations

from pathlib import Path

import pytest

from service import ray_local
from service.errors import InfraError
from service.ray_local import _temp_dir_for, ensure_local_head, head_processes, stop_local_head


def test_a_head_that_never_answers_is_stopped_and_tried_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The probe says "not ready" whatever Ray does: each try must stop what `ray start` left running.
    dashboards: list[str] = []

    def never(url: str, timeout: float = 2.0) -> bool:
        dashboards.append(url)
        return False

    monkeypatch.setattr(ray_local, "dashboard_answers", never)
    data_dir = tmp_path / "head"
    with pytest.raises(InfraError, match="did not answer within 1 s; its log ends"):
        ensure_local_head(data_dir, num_cpus=1, num_gpus=0, ready_seconds=1.0)
    assert len(set(dashboards)) == 2, "the second try must use fresh ports"
    assert head_processes(_temp_dir_for(data_dir)) == [], "a head that never answered was left running"
    assert not (data_dir / ray_local.STATE_FILE).exists()


def test_a_ready_head_is_reattached_not_started_again(tmp_path: Path) -> None:
    data_dir = tmp_path / "head"
    try:
        head = ensure_local_head(data_dir, num_cpus=1, num_gpus=0)
        pids = sorted(head_processes(head.temp_dir))
        again = ensure_local_head(data_dir, num_cpus=1, num_gpus=0)
        assert again == head and sorted(head_processes(head.temp_dir)) == pids
    finally:
        stop_local_head(data_dir)
    assert head_processes(_temp_dir_for(data_dir)) == []
