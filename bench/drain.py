"""A node's end announced ahead (issue 16), side by side in one run on one 3-node local cluster (head + nodes a, b;
`ray.cluster_utils.Cluster`), each case a fresh 2-worker job placed across nodes, losing the node one of its workers
runs on:

- `helpers-drain`: a loop reporting through shunter's helpers (examples.gpt2_tiny); `ray drain-node` with a deadline
  (reason PREEMPTION, as an autoscaler or a spot reclaim gives it), the node removed at the deadline;
- `plain-drain`: a plain Ray Train loop (examples.mlp, which never asks) under the same drain and removal;
- `helpers-loss`: the helpers' loop, the node removed with no notice (a plain worker loss).

For each: the end reason of the first attempt, the seconds from the notice (or the loss) to the job training again
(its first step of attempt 2), and the steps lost (trained in attempt 1 past the step attempt 2 resumed from).

    .venv/bin/python -m bench.drain [--deadline 30] [--checkpoint-every 25]
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import log
from service.backends.ray_local import free_port
from tests.conftest import wait_for
from tests.service.conftest import Service, drain_node, multinode_cluster, service_env, train_worker_nodes

RESULTS = Path(__file__).resolve().parent / "results" / "drain.json"


def spec_for(case: str, args: argparse.Namespace) -> dict[str, Any]:
    resources = {"num_workers": 2, "resources_per_worker": {"CPU": 1}, "placement": "spread"}
    retries = {"max_attempts": 3, "backoff_seconds": 1, "max_backoff_seconds": 1, "max_worker_failures": 0}
    if case == "plain-drain":
        config = {"total_steps": args.steps, "checkpoint_every": args.checkpoint_every, "report_every": 1,
                  "step_sleep": args.step_sleep}  # fmt: skip
        entry = {"callable": "examples.mlp:train_loop"}
    else:
        config = {"steps": args.steps, "checkpoint_every": args.checkpoint_every, "step_sleep": args.step_sleep}
        entry = {"callable": "examples.gpt2_tiny:train_loop"}
    return {"name": case, "entrypoint": entry, "config": config, "resources": resources, "retries": retries}


def one(case: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"shunter-drain-{case}-") as work, multinode_cluster(Path(work)) as mn:
        svc = Service(data_dir=Path(work), port=free_port(), env={})
        svc.env = service_env(Path(work), mn.head, svc.port)
        svc.start()
        try:
            with svc.client() as c:
                job = c.submit(spec_for(case, args))
                wait_for(lambda: (c.get(job.id).step or 0) >= args.at_step, timeout=300, what="job training")
                on = set(train_worker_nodes(mn.head.dashboard_url, f"shunter-{job.id}-1"))
                node = next(n for name, n in mn.workers.items() if n.node_id in on)
                if case.endswith("drain"):
                    t0 = drain_node(mn.head.gcs_address, node.node_id, deadline_s=args.deadline)
                else:
                    t0 = time.monotonic()
                    mn.cluster.remove_node(node, allow_graceful=False)
                removed, again = not case.endswith("drain"), None
                while again is None:
                    if not removed and time.monotonic() - t0 >= args.deadline:
                        mn.cluster.remove_node(node, allow_graceful=False)  # the deadline: the node goes
                        removed = True
                    if any(m.attempt == 2 for m in c.metrics(job.id, name="loss")):
                        again = time.monotonic() - t0
                    elif time.monotonic() - t0 > args.deadline + 300 or c.get(job.id).state == "SUCCEEDED":
                        raise RuntimeError(f"{case}: job {job.id} not training again (finished first? more --steps)")
                    time.sleep(0.2)
                if not removed:
                    time.sleep(max(0.0, args.deadline - (time.monotonic() - t0)))
                    mn.cluster.remove_node(node, allow_graceful=False)
                done = c.wait(job.id, timeout=600)
                losses = c.metrics(job.id, name="loss")
                trained = max(m.step for m in losses if m.attempt == 1)
                resumed = min(m.step for m in losses if m.attempt == 2) - 1
                first = c.attempts(job.id)[0]
                row = {"case": case, "state": done.state, "attempts": done.attempt, "first_end": first.end_reason,
                       "training_again_s": round(again, 1), "steps_lost": trained - resumed,
                       "notice_to_deadline_s": args.deadline if case.endswith("drain") else 0}  # fmt: skip
                # From the moment the node is gone (its deadline, or the loss): negative is before it went.
                row["after_node_end_s"] = round(again - row["notice_to_deadline_s"], 1)
                log(f"{case}: {json.dumps(row)}")
                return row
        finally:
            svc.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deadline", type=int, default=30, help="seconds from the drain notice to the node's end")
    parser.add_argument("--steps", type=int, default=400, help="enough to outlast the deadline after --at-step")
    parser.add_argument("--checkpoint-every", type=int, default=25)
    parser.add_argument("--step-sleep", type=float, default=0.2)
    parser.add_argument("--at-step", type=int, default=30, help="the notice (or loss) comes once the job is here")
    args = parser.parse_args()
    rows = [one(case, args) for case in ("helpers-drain", "plain-drain", "helpers-loss")]
    by = {r["case"]: r for r in rows}
    ratios = {
        # the time from the notice (or the loss) to training again elsewhere
        "training_again_loss_over_drain": round(by["helpers-loss"]["training_again_s"]
                                                / max(by["helpers-drain"]["training_again_s"], 1e-9), 2),
        "training_again_plain_drain_over_drain": round(by["plain-drain"]["training_again_s"]
                                                       / max(by["helpers-drain"]["training_again_s"], 1e-9), 2),
    }  # fmt: skip
    result = {"machine": platform.platform(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "args": vars(args), "cases": rows, "ratios": ratios}  # fmt: skip
    print(f"{'case':<15}{'first end':<16}{'again (s)':>10}{'after end (s)':>14}{'steps lost':>12}{'final':>12}")
    for r in rows:
        print(f"{r['case']:<15}{r['first_end']:<16}{r['training_again_s']:>10}{r['after_node_end_s']:>14}"
              f"{r['steps_lost']:>12}{r['state']:>12}")  # fmt: skip
    print(
        f"steps lost: {by['helpers-drain']['steps_lost']} with a notice and the helpers, "
        f"{by['plain-drain']['steps_lost']} for a plain loop under the same notice, "
        f"{by['helpers-loss']['steps_lost']} on a plain loss (checkpoints every {args.checkpoint_every} steps)"
    )
    print(
        f"training again, from the notice or the loss: a plain loss {ratios['training_again_loss_over_drain']}x "
        f"and a plain loop's drain {ratios['training_again_plain_drain_over_drain']}x the time of a helpers' drain"
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
