"""Part 5: admission and end latency on a real local head (2 CPUs) where two 2-worker jobs cannot both fit.

- From the end of one job (its train loop's last step; Ray's end_time of its Ray Job; its SUCCEEDED event) to the next
  queued job's STARTING event. Negative values: the next job was admitted before that moment (Ray frees the workers'
  CPUs before the driver exits).
- Each job's last progress report to its SUCCEEDED event (the attempt ends on the driver's word), side by side with
  the last report to Ray's end_time of its Ray Job: the soonest the job's end could be known by waiting for Ray, as it
  was before the driver's word counted.
- The first job, posted on an idle cluster: its post to its STARTING event (dispatchers wake on the post).
- A fine-tune waiting on its pre-train (`depends_on` with `as`, its config taking `${deps.pre.checkpoint}`): from the
  pre-train's last report to the fine-tune's STARTING event, which needs the pre-train's last checkpoint recorded.
"""

from __future__ import annotations

import json
import tempfile
from datetime import UTC
from pathlib import Path
from typing import Any

from bench import common
from bench.common import log
from bench.orchestration import shunter_spec, start_service

TICK = 0.25


def _ts(at: Any) -> float:
    return (at if at.tzinfo else at.replace(tzinfo=UTC)).timestamp()


def run(quick: bool) -> dict[str, Any]:
    from ray.job_submission import JobSubmissionClient

    from api.client import Client

    n_jobs = 2 if quick else 3
    head = common.ray_head()
    work = Path(tempfile.mkdtemp(prefix="shunter-bench-admit-"))
    proc, url = start_service(head, work, SHUNTER_DISPATCHER_TICK_SECONDS=str(TICK))
    gaps = []
    try:
        with Client(url) as client:
            jobs = [client.submit(shunter_spec(30, work / f"a{i}.json", f"bench-admit-{i}")) for i in range(n_jobs)]
            for job in jobs:
                final = client.wait(job.id, timeout=300, interval=0.25)
                if final.state != "SUCCEEDED":
                    raise RuntimeError(f"{job.id}: {final.state} {final.last_error}")
            events = {job.id: client.events(job.id) for job in jobs}
            views = {job.id: client.get(job.id) for job in jobs}
        ray = JobSubmissionClient(head.dashboard_url)

        def ray_end_of(job_id: str) -> float:  # the Ray Job may still be exiting after shunter called it ended
            info = common.wait_for(lambda: (i := ray.get_job_info(f"shunter-{job_id}-1")).end_time and i, timeout=120,
                                   interval=0.2, what=f"Ray's end of {job_id}")  # fmt: skip
            return info.end_time / 1000.0

        def at(job_id: str, to: str) -> float:
            return next(_ts(e.at) for e in events[job_id] if e.kind == "state" and e.to_state == to)

        order = sorted(jobs, key=lambda j: at(j.id, "STARTING"))
        for i, (before, after) in enumerate(zip(order, order[1:], strict=False)):
            started = at(after.id, "STARTING")
            # The train loop's own last timestamp: right after it, Ray Train tears the worker group down and the
            # CPUs come back, usually before the driver exits and Ray (then shunter) calls the job ended.
            loop_end = json.loads((work / f"a{jobs.index(before)}.json").read_text())["end_at"]
            ray_end = ray_end_of(before.id)
            gap = {
                "loop_end_to_starting_s": started - loop_end,
                "ray_end_to_starting_s": started - ray_end,
                "succeeded_event_to_starting_s": started - at(before.id, "SUCCEEDED"),
            }
            gaps.append(gap)
            log(f"part 5: pair {i}: loop end -> next STARTING {gap['loop_end_to_starting_s']:.2f}s; Ray Job end -> "
                f"STARTING {gap['ray_end_to_starting_s']:+.2f}s; SUCCEEDED event -> STARTING "
                f"{gap['succeeded_event_to_starting_s']:+.2f}s (tick {TICK}s)")  # fmt: skip
        ends = []
        for job in jobs:
            last_report = _ts(views[job.id].progress_at)
            ends.append({"last_report_to_succeeded_s": at(job.id, "SUCCEEDED") - last_report,
                         "last_report_to_ray_end_s": ray_end_of(job.id) - last_report})  # fmt: skip
            log(f"part 5: {job.id}: last report -> SUCCEEDED {ends[-1]['last_report_to_succeeded_s']:.2f}s; last "
                f"report -> Ray Job end {ends[-1]['last_report_to_ray_end_s']:.2f}s")  # fmt: skip
        dependency = _dependency_start(client_url=url, work=work)
        first = min(jobs, key=lambda j: _ts(views[j.id].created_at))
        posted_to_starting = at(first.id, "STARTING") - _ts(views[first.id].created_at)
        log(f"part 5: posted on an idle cluster -> STARTING {posted_to_starting * 1000:.0f} ms")
        for job_id in [*(j.id for j in jobs), *dependency["jobs"]]:
            ray_end_of(job_id)  # a Ray Job is deleted only once it has ended (its teardown runs past SUCCEEDED)
            ray.delete_job(f"shunter-{job_id}-1")
    finally:
        common.stop(proc, grace=20)
    loop = common.median([g["loop_end_to_starting_s"] for g in gaps])
    rend = common.median([g["ray_end_to_starting_s"] for g in gaps])
    ev = common.median([g["succeeded_event_to_starting_s"] for g in gaps])
    to_succeeded = common.median([e["last_report_to_succeeded_s"] for e in ends])
    to_ray_end = common.median([e["last_report_to_ray_end_s"] for e in ends])
    return {
        "tick_s": TICK,
        "gaps": gaps,
        "median_loop_end_to_starting_s": loop,
        "median_ray_end_to_starting_s": rend,
        "median_succeeded_event_to_starting_s": ev,
        "ends": ends,
        "last_report_to_succeeded_s": to_succeeded,
        "last_report_to_ray_end_s": to_ray_end,
        "posted_to_starting_s": posted_to_starting,
        "dependency_start_s": dependency["dependency_start_s"],
        "ratios": {
            "(loop end -> next STARTING)/tick": loop / TICK,
            "(Ray Job end -> next STARTING)/tick": rend / TICK,
            "(last report -> SUCCEEDED)/(last report -> Ray Job end)": to_succeeded / to_ray_end,
        },
        "targets": {
            "loop end -> next STARTING <= one tick": loop <= TICK,
            "last report -> SUCCEEDED <= 1 s (median)": to_succeeded <= 1.0,
            "posted on an idle cluster -> STARTING <= 100 ms": posted_to_starting <= 0.1,
            "dependency's last report -> dependent STARTING <= 1 s": dependency["dependency_start_s"] <= 1.0,
        },
    }


def _dependency_start(*, client_url: str, work: Path) -> dict[str, Any]:
    """A pre-train and its fine-tune (posted together): the pre-train's last report -> the fine-tune's STARTING."""
    from api.client import Client

    def spec(name: str, **config: Any) -> dict[str, Any]:
        return {"name": name, "entrypoint": {"callable": "examples.mlp:train_loop"},
                "resources": {"num_workers": 2, "resources_per_worker": {"CPU": 1}},
                "config": {"total_steps": 30, "checkpoint_every": 10, "report_every": 1, **config}}  # fmt: skip

    with Client(client_url) as client:
        pre = client.submit(spec("bench-pre"))
        fine = client.submit({**spec("bench-fine", total_steps=10, init_from="${deps.pre.checkpoint}"),
                              "depends_on": [{"job": pre.id, "as": "pre"}]})  # fmt: skip
        for job in (pre, fine):
            final = client.wait(job.id, timeout=300, interval=0.25)
            if final.state != "SUCCEEDED":
                raise RuntimeError(f"{job.id}: {final.state} {final.last_error}")
        last_report = _ts(client.get(pre.id).progress_at)
        started = next(_ts(e.at) for e in client.events(fine.id) if e.kind == "state" and e.to_state == "STARTING")
    gap = started - last_report
    log(f"part 5: dependency's last report -> dependent STARTING {gap:.2f}s")
    return {"dependency_start_s": gap, "jobs": [pre.id, fine.id]}
