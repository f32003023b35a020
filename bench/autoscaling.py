"""A queue that grows the cluster (issue 37), timed: Ray's real autoscaler with its fake node provider (each "node"
is local processes, tests/autoscaling.py), a head with no CPUs, node type `cpu1` (1 CPU, up to 2), and a real
`shunter serve` with `SHUNTER_CLUSTER_MAY_GROW=true` and `SHUNTER_NODE_TYPES`. Each round submits one 2-worker
MLP job to an empty cluster, waits for it to succeed, then for the idle nodes to go. Per round, from the job's
events and Ray's own node records:

- queue -> capacity requested: the job's creation to its `scale_requested` event;
- requested -> nodes up: that event to the second worker node's start (Ray's `start_time_ms`; the fake provider
  starts processes, a cloud would start machines);
- nodes up -> STARTING: the second node's start to the job's admission;
- queue empty -> nodes released: the job's end to the last worker node leaving `GET /v1/cluster` (idle timeout 6 s).

    .venv/bin/python -m bench.autoscaling [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from bench.common import log
from tests.autoscaling import autoscaling_head
from tests.conftest import wait_for
from tests.external_ray import serve_against
from tests.service.test_e2e_serve import mlp_spec

RESULTS = Path(__file__).resolve().parent / "results" / "autoscaling.json"
NODE_TYPES = {"cpu1": {"resources": {"CPU": 1}, "max": 2}}


def worker_nodes(http: httpx.Client) -> list[dict[str, Any]]:
    return [n for n in http.get("/v1/cluster").json()["nodes"] if n.get("alive", True) and n["total"].get("CPU")]


def node_starts(dashboard_url: str) -> list[float]:
    """Start times (epoch seconds) of the nodes that hold CPUs, from Ray's state API."""
    from ray.util.state import list_nodes

    nodes = list_nodes(address=dashboard_url, limit=1000, detail=True)
    return sorted(n.start_time_ms / 1000 for n in nodes if n.resources_total.get("CPU") and n.start_time_ms)


def one_round(c: Any, http: httpx.Client, dashboard_url: str, known: int) -> dict[str, float]:
    job = c.submit(mlp_spec(total_steps=8) | {"name": "autoscaled"})
    done = c.wait(job.id, timeout=300)
    assert done.state == "SUCCEEDED", (done.state, done.last_error)
    events = c.events(job.id)
    asked = next(e.at for e in events if e.reason == "scale_requested")
    admitted = next(e.at for e in events if e.kind == "state" and e.to_state == "STARTING")
    ended = next(e.at for e in events if e.kind == "state" and e.to_state == "SUCCEEDED")
    up = node_starts(dashboard_url)[known:]
    assert len(up) >= 2, up
    second = up[1]
    wait_for(lambda: worker_nodes(http) == [], timeout=300, what="the idle nodes released")
    released = time.time()
    return {
        "queue_to_requested": (asked - done.created_at).total_seconds(),
        "requested_to_nodes_up": second - asked.timestamp(),
        "nodes_up_to_starting": admitted.timestamp() - second,
        "queue_empty_to_released": released - ended.timestamp(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    rounds: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="shunter-autoscaling-") as work, autoscaling_head(NODE_TYPES) as head:
        svc = serve_against(
            head, Path(work), SHUNTER_CLUSTER_MAY_GROW="true", SHUNTER_NODE_TYPES=json.dumps(NODE_TYPES)
        )
        try:
            c, http = svc.client(), httpx.Client(base_url=svc.url, timeout=30)
            for i in range(args.rounds):
                rounds.append(one_round(c, http, head.dashboard_url, known=2 * i))
                log(f"round {i + 1}: " + ", ".join(f"{k} {v:.1f} s" for k, v in rounds[-1].items()))
        finally:
            svc.stop()
    medians = {k: round(statistics.median(r[k] for r in rounds), 2) for k in rounds[0]}
    result = {"when": datetime.now().isoformat(timespec="seconds"), "machine": platform.node(),
              "rounds": rounds, "median_seconds": medians}  # fmt: skip
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(medians, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
