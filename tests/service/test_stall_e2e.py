"""Hang detection end to end (issue 17): a real `shunter serve` and the session's Ray head, real DDP training.

A train loop that reports three steps and then blocks (on every rank) ends `stalled` within its stall timeout plus
the dump's few seconds, with every rank's faulthandler stack, the blocking function's name included, in the log the
service kept for the attempt. A loop that never reports is not called stalled, however long it is quiet: it runs
into its `timeout_seconds`. Both run at once (3 of the head's 4 CPUs), so the test takes one job's time."""

from __future__ import annotations

import time

import pytest

from service.dispatch.host_files import HostFiles
from tests.conftest import wait_for
from tests.service.conftest import Service
from tests.service.test_e2e_serve import mlp_spec

pytestmark = pytest.mark.slow
STALL_SECONDS = 10


def test_a_loop_that_stops_reporting_is_stalled_with_every_ranks_stack_in_its_log(service: Service) -> None:
    hangs = mlp_spec(total_steps=1000, checkpoint_every=1000, report_every=1, hang_at_step=3)
    hangs.update(name="hangs-after-step-3", stall_timeout_seconds=STALL_SECONDS, retries={"max_attempts": 1})
    silent = mlp_spec(total_steps=1000, checkpoint_every=1000, hang_at_step=0)  # blocks before its first report
    silent.update(name="never-reports", stall_timeout_seconds=3, timeout_seconds=40, retries={"max_attempts": 1})
    silent["resources"] = {"num_workers": 1, "resources_per_worker": {"CPU": 1}}
    with service.client() as c:
        hung_id, silent_id = c.submit(hangs).id, c.submit(silent).id
        wait_for(lambda: c.get(hung_id).step == 3, timeout=180, what="the loop's three steps")
        quiet_since = time.monotonic()
        job = c.wait(hung_id, timeout=120)
        took = time.monotonic() - quiet_since
        assert job.state == "FAILED" and job.end_reason == "stalled", (job.end_reason, job.last_error)
        assert took < STALL_SECONDS + 45, f"stalled {took:.0f}s after its last report (timeout {STALL_SECONDS}s)"
        assert "since step 3; every rank's stack is in the attempt's log" in (job.last_error or ""), job.last_error
        assert "asked 2 process(es) for their stack: 2 train worker(s)" in (job.last_error or ""), job.last_error
        stall = [(e.reason, e.message or "") for e in c.events(hung_id) if e.kind == "stall"]
        assert [reason for reason, _ in stall] == ["stalled", "stack_dump"], stall
        assert f"stall timeout {STALL_SECONDS}s" in stall[0][1] and "since step 3" in stall[0][1]
        (attempt,) = c.attempts(hung_id)
        assert attempt.end_reason == "stalled", attempt
        kept = HostFiles(service.data_dir).log_path(hung_id, 1)  # the log shunter keeps of the attempt
        assert kept.exists()
        log = kept.read_text()
        assert c.logs(hung_id) == log
        # faulthandler's dump: every thread of each rank, innermost frame first, down into the blocking function.
        assert "Thread 0x" in log and "(most recent call first)" in log, log[-3000:]
        assert "in block_forever" in log and "examples/mlp.py" in log, log[-3000:]
        assert log.count("in run_loop") >= 1, log[-3000:]

        quiet = c.wait(silent_id, timeout=120)
        assert quiet.state == "FAILED" and quiet.end_reason == "timeout", (quiet.end_reason, quiet.last_error)
        assert [e for e in c.events(silent_id) if e.kind == "stall"] == []
        stacks = [line for line in log.splitlines() if "File " in line or "Thread 0x" in line]
        print(f"stalled {took:.1f}s after its last report; the log's stacks:\n" + "\n".join(stacks)[:4000])
