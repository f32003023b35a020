"""What one dispatcher has seen of Ray's nodes going away: to bear out an attempt's claim that its node drained.

A `node_draining` end is not counted against `max_attempts` (service.policy.retry), and it is claimed from the job's
side (its driver, with the attempt's token), so a job could claim it after every failure. The dispatcher counts it as a
drain only when a node the claim names was first seen draining or dead after the attempt started: a node that drains
is no longer offered to new work, so a real drain of an attempt's node always begins after that attempt started.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone

from service.core.backend import ClusterView

NODE_ID = re.compile(r"\b[0-9a-f]{16,}\b")
KEPT = 100_000  # node ids remembered at most (a dispatcher's lifetime of node losses fits many times over)


class NodeHistory:
    def __init__(self) -> None:
        self.gone_since: dict[str, datetime] = {}  # node id -> when first seen draining or dead

    def observe(self, cluster: ClusterView, now: datetime) -> None:
        for node_id in [*cluster.dead_nodes, *(n.node_id for n in cluster.nodes if not n.alive)]:
            if len(self.gone_since) < KEPT:
                self.gone_since.setdefault(node_id, now)

    def confirms(self, started: datetime, claim: str) -> bool:
        """Whether a node named in `claim` went draining or dead after `started` (the attempt's start)."""
        started = started if started.tzinfo else started.replace(tzinfo=timezone.utc)
        return any(self.gone_since.get(n, started) > started for n in NODE_ID.findall(claim))
