"""A sweep end to end (issue 18): a real `shunter serve` on the session's Ray head runs a grid of two members of the
tiny MLP at max_parallel 1: one member at a time, in index order, the other waiting with the reason; both succeed,
and the sweep's best member is the one whose final reported loss is lowest. (A 2x2 grid's expansion order is proven
in tests/api/test_sweeps_api.py, the hold of four members at max_parallel 1 in tests/service/test_sweeps.py, and
ranking on its table there: two members on real Ray are what this end-to-end proof needs.)"""

from __future__ import annotations

import pytest

from tests.conftest import wait_for
from tests.service.conftest import Service

pytestmark = pytest.mark.slow

REQUEST = {
    "name": "mlp-grid",
    "base": {
        "entrypoint": {"callable": "examples.mlp:train_loop"},
        "config": {"total_steps": 6, "checkpoint_every": 6, "report_every": 2, "batch_size": 32, "hidden": 8},
        "resources": {"num_workers": 1},
        "preflight": {"enabled": False},  # one worker: nothing to check between ranks, and a few seconds saved
    },
    "grid": {"lr": [0.0005, 0.02]},
    "max_parallel": 1,
    "metric": {"name": "loss", "mode": "min"},
}


def test_a_sweep_runs_one_member_at_a_time_and_ranks_by_loss(service: Service) -> None:
    with service.client() as c:
        sweep = c.submit_sweep(REQUEST)
        ids = [m.job_id for m in sweep.members]
        assert [m.values for m in sweep.members] == [{"lr": 0.0005}, {"lr": 0.02}]
        # While the first member runs, the next one waits on the sweep's limit, and say so.
        wait_for(lambda: c.get(ids[0]).state in ("STARTING", "RUNNING"), timeout=60, what="member 0 admitted")
        said = f"sweep {sweep.id} has 1 of max_parallel 1 members running"
        wait_for(lambda: c.get(ids[1]).state_reason == said, timeout=30, what=f"member 1's reason: {said}")
        assert c.get(ids[1]).state == "QUEUED"

        done = wait_for(lambda: (s := c.sweep(sweep.id)).done and s, timeout=600, interval=1.0, what="the sweep")
        assert done.counts == {"SUCCEEDED": 2}, [(m.state, m.end_reason) for m in done.members]

        # Never two members admitted at once: from each member's own timeline (admitted -> ended), in index order.
        spans = []
        for job_id in ids:
            changes = [e for e in c.events(job_id) if e.kind == "state"]
            started = next(e.at for e in changes if e.to_state == "STARTING")
            ended = next(e.at for e in changes if e.to_state == "SUCCEEDED")
            spans.append((started, ended))
        assert [s for s, _ in spans] == sorted(s for s, _ in spans)  # lower index first
        for (_, ended), (next_start, _) in zip(spans, spans[1:], strict=False):
            assert ended <= next_start, spans

        # The best member is the lowest final loss, as each job's own metric series tells it.
        final = {job_id: c.metrics(job_id, name="loss")[-1].value for job_id in ids}
        assert len(set(final.values())) == 2, final  # distinct configurations, distinct results
        assert done.best is not None and done.best.job_id == min(final, key=lambda j: final[j])
        assert [m.metric for m in done.members] == [final[j] for j in ids]
        assert sorted(m.rank for m in done.members if m.rank) == [1, 2]
