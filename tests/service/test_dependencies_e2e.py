"""Dependencies end to end on real Ray through a real `shunter serve`: a pre-train, then a fine-tune submitted at once
that waits for it and starts from its checkpoint; and a failing job that ends its dependent."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.service.conftest import Service

pytestmark = pytest.mark.slow


def mlp(**config: object) -> dict:
    return {
        "entrypoint": {"callable": "examples.mlp:train_loop"},
        "config": {"checkpoint_every": 5, "report_every": 5, **config},
        "resources": {"num_workers": 1, "resources_per_worker": {"CPU": 1}},
    }


def test_a_fine_tune_starts_from_its_pre_trains_checkpoint_and_a_failed_dependency_ends_its_dependent(
    service: Service,
) -> None:
    with service.client() as c:
        pre = c.submit({**mlp(total_steps=10), "name": "pre"})
        fine = c.submit({**mlp(total_steps=5, init_from="${deps.pre.checkpoint}", lr=1e-3), "name": "fine",
                         "depends_on": [{"job": pre.id, "as": "pre"}]})  # fmt: skip
        broken = c.submit({**mlp(total_steps=10, fail_at_step=2), "name": "broken"})
        orphan = c.submit({**mlp(total_steps=5), "name": "orphan", "depends_on": [{"job": broken.id}]})
        assert (fine.state, fine.waiting_on) == ("QUEUED", 1)
        assert fine.state_reason == f"waiting for job {pre.id} to succeed (1 of 1 dependency left)"

        ended_orphan = c.wait(orphan.id, timeout=240)
        assert c.get(broken.id).state == "FAILED"
        assert (ended_orphan.state, ended_orphan.end_reason) == ("FAILED", "dependency_failed")
        assert ended_orphan.attempt == 0  # it never ran
        assert ended_orphan.last_error == f"dependency {broken.id} ended FAILED and can no longer succeed"

        done_pre = c.wait(pre.id, timeout=240)
        assert done_pre.state == "SUCCEEDED", done_pre.last_error
        assert done_pre.latest_checkpoint and Path(done_pre.latest_checkpoint, "state.pt").is_file()
        done = c.wait(fine.id, timeout=240)
        assert done.state == "SUCCEEDED", done.last_error
        # It started only after the pre-train had ended...
        pre_end = next(e.at for e in c.events(pre.id) if e.to_state == "SUCCEEDED")
        fine_start = next(e.at for e in c.events(fine.id) if e.to_state == "STARTING")
        assert fine_start >= pre_end
        # ...from the pre-train's last checkpoint (step 10): the train loop loaded it and says so in every report.
        assert done.latest_metrics is not None and done.latest_metrics["init_from_step"] == 10
        assert f"initialised from {done_pre.latest_checkpoint} (its step 10)" in c.logs(fine.id)
        shown = c.get(fine.id)
        assert [(d.job, d.status, d.checkpoint) for d in shown.dependencies or []] == [
            (pre.id, "met", done_pre.latest_checkpoint)
        ]
        assert shown.spec["config"]["init_from"] == "${deps.pre.checkpoint}"  # the stored spec is as written
