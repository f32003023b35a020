"""The dispatcher's read of the cluster, each tick and before each wake-up pass: Ray's per-node resources, checked for
shape, what they say of the nodes (`NodeHistory`: draining or dead, and when; which are dead now, for reconcile), and
the snapshot `GET /v1/cluster` serves. A part of `service.dispatch.dispatcher.Dispatcher`."""

from __future__ import annotations

import logging
import time

from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from service.core.backend import Backend, ClusterView, checked
from service.dispatch.nodes import NodeHistory
from service.dispatch.scaling import Scaling
from service.store.db import session_scope
from service.store.models import ClusterSnapshot, utcnow

log = logging.getLogger(__name__)
SNAPSHOT_REFRESH_SECONDS = 5.0  # an unchanged snapshot is stored again this often


class ClusterReads:
    def __init__(self, *, engine: Engine, ray: Backend, nodes: NodeHistory, scaling: Scaling) -> None:
        self.engine, self.ray, self.nodes, self.scaling = engine, ray, nodes, scaling
        self.dead_nodes: dict[str, bool] = {}  # from the last read (service.policy.reconcile.decide)
        self._stored: tuple[object, float] | None = None  # the last snapshot stored, and when (monotonic)

    def read(self, *, store: bool = True) -> ClusterView | None:
        """Ray's per-node resources, checked for shape, and stored for the API (each tick; `store`); None if Ray cannot
        be read."""
        try:
            cluster = checked(self.ray.cluster())
        except Exception as exc:  # noqa: BLE001 - unreachable, or an answer of the wrong shape: skip admission
            log.warning("cannot read Ray cluster resources: %s", exc)
            return None
        self.dead_nodes = dict(cluster.dead_nodes)
        self.nodes.observe(cluster, utcnow())
        for first in (True, False) if store else ():
            try:
                self._store_snapshot(cluster)
                break
            except IntegrityError as exc:  # another dispatcher stored the first one meanwhile: now it is an update
                if not first:
                    log.warning("cannot store the cluster snapshot: %s", exc)
            except SQLAlchemyError as exc:
                log.warning("cannot store the cluster snapshot: %s", exc)
                break
        return cluster

    def _store_snapshot(self, cluster: ClusterView) -> None:
        """Store what was read, when it differs from what this dispatcher stored last or that is
        SNAPSHOT_REFRESH_SECONDS old (a write transaction at every tick was much of an idle service's CPU)."""
        nodes = [{"node_id": n.node_id, "address": n.address, "alive": n.alive, "total": n.total,
                  "available": n.available} for n in cluster.nodes]  # fmt: skip
        seen = (self.ray.dashboard_url, nodes, cluster.total, cluster.available, self.scaling.view())
        if self._stored is not None and self._stored[0] == seen and time.monotonic() < self._stored[1]:
            return
        with session_scope(self.engine) as session:
            snap = session.get(ClusterSnapshot, 1) or ClusterSnapshot(id=1)
            snap.dashboard_url, snap.nodes, snap.total, snap.available, snap.scale_request = seen
            snap.taken_at = utcnow()
            session.add(snap)
        self._stored = (seen, time.monotonic() + SNAPSHOT_REFRESH_SECONDS)
