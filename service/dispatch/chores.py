"""Cluster-wide housekeeping a dispatcher does now and then, whichever dispatcher it is: what it removes belongs to
no live job. Each chore runs at most once per its interval; a failure is logged and the next turn tries again."""

from __future__ import annotations

import logging
import time

from sqlalchemy.engine import Engine

from service.config.settings import Settings
from service.core.backend import Backend
from service.tenancy import code_archives

log = logging.getLogger(__name__)


class Chores:
    def __init__(self, *, engine: Engine, settings: Settings, ray: Backend) -> None:
        self.engine, self.settings, self.ray = engine, settings, ray
        self._next_sweep = 0.0  # when to look for placement groups Ray left held (monotonic)
        self._next_code_expiry = 0.0  # when to delete code archives nobody uses (monotonic)

    def sweep_placement_groups(self) -> None:
        """Every `placement_group_sweep_seconds`, have the backend remove the placement groups Ray left held for
        ended jobs (`RayJobs.free_orphaned_placement_groups`; a backend without the need has no such method). Any
        dispatcher may do it for the whole cluster: what it removes belongs to no live job."""
        sweep = getattr(self.ray, "free_orphaned_placement_groups", None)
        if sweep is None or time.monotonic() < self._next_sweep:
            return
        self._next_sweep = time.monotonic() + self.settings.placement_group_sweep_seconds
        try:
            sweep()
        except Exception as exc:  # noqa: BLE001 - the GCS's own errors; the next sweep tries again
            log.warning("cannot sweep Ray's placement groups: %s", exc)

    def expire_code_archives(self) -> list[tuple[str, str]]:
        """Every `code_expiry_seconds`, delete the code archives unused for `code_retention_days` that no job that has
        not ended names (`code_archives.expire`); returns (owner, sha256) of those deleted. Any dispatcher may:
        each deletion re-reads its archive's row under a lock."""
        if time.monotonic() < self._next_code_expiry:
            return []
        self._next_code_expiry = time.monotonic() + self.settings.code_expiry_seconds
        try:
            return code_archives.expire(self.engine, self.settings)
        except Exception as exc:  # noqa: BLE001 - the database's or the storage's; the next pass tries again
            log.warning("cannot expire code archives: %s", exc)
            return []
