"""The pre-flight check's result as shunter keeps it (`Attempt.preflight`), and its one-line summary.

The check itself runs in the job's workers (`workers.preflight`); what they send is untrusted input like any job's
report, so it is read into a closed, bounded model here, and only that is stored: it reads back as it was written.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool
from sqlmodel import Session, col, select

from service.lifecycle.state import record_event
from service.store.db import begin_write
from service.store.models import ACTIVE_STATES, Attempt, EventKind, Job

MAX_RANKS = 128  # `workers.preflight.MAX_RANKS_LISTED`: larger groups list only the ranks that failed or were slow
Seconds = Annotated[float, Field(ge=0, le=86400, allow_inf_nan=False)]
Rate = Annotated[float, Field(ge=0, le=1e6, allow_inf_nan=False)]
Gigabytes = Annotated[float, Field(ge=0, le=1e6, allow_inf_nan=False)]
Rank = Annotated[int, Field(ge=0, le=1_000_000)]
Text = Annotated[str, Field(max_length=255)]


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RankFacts(_Closed):
    rank: Rank
    local_rank: Rank | None = None
    node_id: Text | None = None
    address: Text | None = None
    hostname: Text | None = None
    pid: int | None = Field(None, ge=0, le=2**31)
    device: Text | None = None
    gpu: Text | None = None
    cuda: Text | None = None
    driver: Text | None = None
    gpu_free_gb: Gigabytes | None = None
    gpu_total_gb: Gigabytes | None = None
    cpus: int | None = Field(None, ge=0, le=1_000_000)
    cpus_usable: int | None = Field(None, ge=0, le=1_000_000)
    mem_available_gb: Gigabytes | None = None
    rendezvous_seconds: Seconds | None = None
    compute_seconds: Seconds | None = None
    p2p_seconds: Seconds | None = None


class SlowRank(_Closed):
    rank: Rank
    node_id: Text | None = None
    address: Text | None = None
    what: Annotated[str, Field(max_length=32)]
    factor: Rate


class Failure(_Closed):
    rank: Rank | None = None  # None: the check hung with every rank in it, no single one to name
    node_id: Text | None = None
    address: Text | None = None
    why: Annotated[str, Field(max_length=2000)]


class PreflightReport(_Closed):
    ok: StrictBool
    seconds: Seconds
    world_size: int = Field(ge=1, le=1_000_000)
    backend: Annotated[str, Field(max_length=16)] = "none"
    rendezvous_seconds: Seconds | None = None
    allreduce_seconds: Seconds | None = None
    allreduce_gbps: Rate | None = None
    p2p_gbps: Rate | None = None
    ranks: list[RankFacts] = Field(default_factory=list, max_length=MAX_RANKS)
    slow: list[SlowRank] = Field(default_factory=list, max_length=MAX_RANKS)
    failed: Failure | None = None
    warnings: list[Annotated[str, Field(max_length=1000)]] = Field(default_factory=list, max_length=16)


def summary(report: dict[str, Any] | None) -> str | None:
    """One line for `shunter status` and the event: passed or failed, in how long, the bandwidths, who was slow."""
    if not report:
        return None
    r = PreflightReport.model_validate(report)
    if r.failed is not None:
        return f"failed in {r.seconds:.2f}s: {failure_text(r.failed)}"
    parts = [f"passed in {r.seconds:.2f}s ({r.world_size} ranks, {r.backend})"]
    if r.rendezvous_seconds is not None and r.world_size > 1:
        parts.append(f"rendezvous {r.rendezvous_seconds:.2f}s")
    if r.allreduce_gbps is not None:
        parts.append(f"all-reduce {r.allreduce_gbps:.2f} GB/s")
    if r.p2p_gbps is not None:
        parts.append(f"point-to-point {r.p2p_gbps:.2f} GB/s")
    if r.slow:
        parts.append("slow: " + ", ".join(f"rank {s.rank} ({s.what} {s.factor:g}x)" for s in r.slow))
    return "; ".join(parts)


def failure_text(failed: Failure) -> str:
    if failed.rank is None:
        return failed.why
    return f"rank {failed.rank} on node {failed.node_id or 'unknown'} ({failed.address or 'address unknown'}): " + (
        failed.why
    )


def record(session: Session, *, job_id: str, attempt: int, report: PreflightReport) -> bool:
    """Keep the attempt's first pre-flight result (on a failure every rank that saw it sends one), with an event, and
    a warning for a slow rank on CPU. False when fenced off (not the job's current, active attempt) or already kept."""
    begin_write(session)
    current = session.exec(
        select(col(Job.id)).where(col(Job.id) == job_id, col(Job.attempt) == attempt, col(Job.state).in_(ACTIVE_STATES))
    ).first()
    row = session.exec(select(Attempt).where(Attempt.job_id == job_id, Attempt.number == attempt)).first()
    if current is None or row is None or row.preflight is not None:
        session.rollback()
        return False
    stored = report.model_dump(mode="json")
    row.preflight = stored
    session.add(row)
    reason = "preflight_passed" if report.failed is None else "preflight_failed"
    record_event(session, job_id, kind=EventKind.PREFLIGHT, reason=reason, message=summary(stored), attempt=attempt)
    for warning in report.warnings:
        record_event(session, job_id, kind=EventKind.WARNING, reason="preflight_slow_rank", message=warning,
                     attempt=attempt)  # fmt: skip
    session.commit()
    return True
