"""A Ray cluster that grows and shrinks on this machine: a `ray start --head` (no CPUs of its own) running Ray's real
autoscaler (v1 monitor) with Ray's fake node provider, which starts each "node" as local processes
(`ray/autoscaler/_private/fake_multi_node`). What issue 37's tests and `bench.autoscaling` run against.

Not `ray.cluster_utils.AutoscalingCluster`: in the 2.60 wheel it reads an `example.yaml` that is not shipped, and its
start and shutdown run `ray stop --force`, which would kill every Ray on the machine (another lane's head included).
The autoscaler's v1 monitor fills in no defaults, so the config names every top-level key.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.external_ray import ExternalHead

OBJECT_STORE = 100 * 1024 * 1024  # a fake node's object store (Ray's minimum is 75 MiB)


def node_types_config(node_types: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """`available_node_types` for the fake provider from shunter's `SHUNTER_NODE_TYPES` shape."""
    out: dict[str, Any] = {"ray.head.default": {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0}}
    for name, kind in node_types.items():
        out[name] = {"resources": {**kind["resources"], "object_store_memory": OBJECT_STORE}, "node_config": {},
                     "min_workers": 0, "max_workers": kind["max"]}  # fmt: skip
    return out


class AutoscalingHead(ExternalHead):
    """A head with no CPUs whose autoscaler adds `node_types` nodes on demand and removes them idle."""

    def __init__(self, node_types: dict[str, dict[str, Any]], *, idle_timeout_minutes: float = 0.1) -> None:
        super().__init__(num_cpus=0)
        self.node_types, self.idle_timeout_minutes = node_types, idle_timeout_minutes
        self.config_path = Path(self.temp_dir) / "autoscaler.yaml"

    def config(self) -> dict[str, Any]:
        return {
            "cluster_name": f"shunter-fake-{self.port}",
            "max_workers": sum(int(t["max"]) for t in self.node_types.values()),
            "upscaling_speed": 10.0,
            "idle_timeout_minutes": self.idle_timeout_minutes,
            "provider": {
                "type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                "disable_launch_config_check": True, "gcs_address": self.gcs_address,
            },  # fmt: skip
            "available_node_types": node_types_config(self.node_types),
            "head_node_type": "ray.head.default",
            "auth": {}, "docker": {}, "file_mounts": {}, "cluster_synced_files": [],
            "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
            "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
            "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
        }  # fmt: skip

    def environment(self) -> dict[str, str]:
        env = super().environment()
        # The fake provider refuses to run without it; the monitor looks at demand every second, not every 5.
        env.update(RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1")
        return env

    def start(self, tries: int = 3) -> None:
        self.config_path.write_text(json.dumps(self.config()))  # JSON is YAML
        super().start(tries)

    def _spawn(self, cmd: list[str], env: dict[str, str]) -> None:
        super()._spawn([*cmd, f"--autoscaling-config={self.config_path}"], env)

    def kill(self) -> None:
        """Every process of the cluster: the head's, and the fake nodes' (the monitor starts them; they name the
        head's GCS address on their command lines)."""
        import psutil

        mine = []
        for proc in psutil.process_iter(["pid", "cmdline"]):
            with contextlib.suppress(psutil.Error, TypeError):
                if any(self.gcs_address in part for part in proc.info["cmdline"] or ()):
                    mine.append(proc.info["pid"])
        super().kill()
        for pid in mine:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def autoscaling_head(node_types: dict[str, dict[str, Any]], **kw: Any) -> Iterator[AutoscalingHead]:
    head = AutoscalingHead(node_types, **kw)
    head.start()
    try:
        yield head
    finally:
        head.kill()
