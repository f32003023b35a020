"""The pre-flight check on a real gloo process group of two processes (torch's own rendezvous store, no Ray): it
passes on healthy ranks, and a rank made to fail it (`SHUNTER_PREFLIGHT_INJECT`, set on that rank only) is the one
named, whether it sends a wrong value, hangs, raises, or is slow (which on CPU only warns)."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from service.lifecycle.preflight_results import PreflightReport, summary

TIMEOUT = 3.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, world: int, port: int, inject: str, bad: int, out: str) -> None:
    import torch.distributed as dist

    from workers import preflight

    if rank == bad and inject:
        os.environ[preflight.INJECT_ENV] = inject
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    check = preflight._Check(rank=rank, world=world, local_rank=rank, timeout=TIMEOUT, slow_factor=4.0)
    report = check.run()
    Path(out, f"{rank}.json").write_text(json.dumps(report))
    sys.stdout.flush()
    os._exit(0)  # a rank left hanging by its peer's injected fault must not hold the process group's teardown


def run_check(tmp_path: Path, *, inject: str = "", bad: int = 1, world: int = 2) -> dict[int, dict]:
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, inject, bad, str(tmp_path))) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 60
    for r, p in enumerate(procs):
        if r == bad and inject == "hang":
            continue  # it sleeps; killed below
        p.join(timeout=max(1.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return {int(f.stem): json.loads(f.read_text()) for f in tmp_path.glob("*.json")}


def test_healthy_ranks_pass_with_facts_timings_and_bandwidth(tmp_path: Path) -> None:
    reports = run_check(tmp_path)
    assert set(reports) == {0, 1}
    report = PreflightReport.model_validate(reports[0])  # what the API stores: the closed model reads it whole
    assert report.ok and report.failed is None and report.backend == "gloo" and report.world_size == 2
    assert report.allreduce_gbps and report.allreduce_gbps > 0 and report.p2p_gbps and report.p2p_gbps > 0
    assert [r.rank for r in report.ranks] == [0, 1]
    for facts in report.ranks:
        assert facts.device == "cpu" and facts.cpus and facts.compute_seconds is not None
        assert facts.p2p_seconds is not None and facts.mem_available_gb
    # Seconds, not the 60 s a step may take (its timeout): what it costs is bench/preflight.py's to measure.
    assert report.seconds < 20.0, report.seconds
    assert (summary(reports[0]) or "").startswith("passed in ")


def test_a_rank_that_sends_the_wrong_value_is_named_by_every_rank(tmp_path: Path) -> None:
    reports = run_check(tmp_path, inject="wrong_sum")
    for report in reports.values():
        assert report["failed"]["rank"] == 1, report
        assert "instead of 2" in report["failed"]["why"]
    assert len(reports) == 2


def test_a_rank_that_hangs_is_named_by_the_others_within_the_timeout(tmp_path: Path) -> None:
    began = time.monotonic()
    reports = run_check(tmp_path, inject="hang")
    assert set(reports) == {0}  # the hung rank never finished; its peer named it
    failed = reports[0]["failed"]
    assert failed["rank"] == 1 and "did not join the all-reduce" in failed["why"], failed
    assert time.monotonic() - began < 30


def test_a_rank_whose_check_raises_names_itself_and_its_peer_names_it_too(tmp_path: Path) -> None:
    reports = run_check(tmp_path, inject="error")
    assert reports[1]["failed"]["rank"] == 1 and "the check raised RuntimeError" in reports[1]["failed"]["why"]
    assert reports[0]["failed"]["rank"] == 1, reports[0]["failed"]


def test_a_slow_rank_on_cpu_only_warns(tmp_path: Path) -> None:
    reports = run_check(tmp_path, inject="slow", bad=0)
    report = reports[1]
    assert report["ok"] and report["failed"] is None
    assert any(s["rank"] == 0 and s["what"] == "compute" for s in report["slow"]), report["slow"]
    assert report["warnings"] and "on CPU this only warns" in report["warnings"][0]


@pytest.mark.parametrize("patch", [{"seconds": float("nan")}, {"ranks": [{"rank": -1}]}, {"extra": 1},
                                   {"failed": {"why": "x" * 2001}}, {"ranks": [{"rank": 0}] * 129}])  # fmt: skip
def test_the_stored_model_refuses_what_a_crafted_report_might_carry(patch: dict) -> None:
    from pydantic import ValidationError

    body = {"ok": True, "seconds": 0.1, "world_size": 2, **patch}
    with pytest.raises(ValidationError):
        PreflightReport.model_validate(body)
