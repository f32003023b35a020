"""A stand-in for Ray that "runs" every job instantly: for draining thousands of claims in stress tests and
benchmarks of the queue, where Ray's ~10 s per job would only hide what the database does.

It implements the Ray adapter's interface for real, across processes: each submission is a file created with
O_EXCL in a shared directory, so a second submission of one id fails exactly as Ray refuses it, and every
submission call is appended to `submits.log` so a test can count them. It never stands in for Ray in a test of
training, placement or fault handling.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from service.errors import InfraError
from service.ray_jobs import ClusterView, NodeView, RayJobInfo


class NoopJobs:
    dashboard_url = "noop://"
    gcs_address = None

    def __init__(self, directory: str | Path, *, cpus: float = 1e9) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cpus = cpus

    def close(self) -> None:
        pass

    def ping(self) -> bool:
        return self.dir.is_dir()

    def info(self, submission_id: str) -> RayJobInfo | None:
        return RayJobInfo(submission_id, "SUCCEEDED") if (self.dir / submission_id).exists() else None

    def submit(
        self, *, submission_id: str, entrypoint: str, runtime_env: dict[str, Any], metadata: dict[str, str]
    ) -> bool:
        with open(self.dir / "submits.log", "a") as log:
            log.write(f"{submission_id} {os.getpid()}\n")
        try:
            fd = os.open(self.dir / submission_id, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False  # adopted, as RayJobs.submit does when the id exists
        except OSError as exc:
            raise InfraError(f"noop backend: {exc}") from exc
        os.close(fd)
        return True

    def stop(self, submission_id: str) -> bool:
        return False

    def logs(self, submission_id: str) -> str | None:
        return None

    def list_submission_ids(self, prefix: str = "shunter-") -> list[str]:
        return sorted(p.name for p in self.dir.iterdir() if p.name.startswith(prefix))

    def cluster(self) -> ClusterView:
        total = {"CPU": self.cpus, "GPU": 0.0, "memory": 1e15}
        return ClusterView(nodes=[NodeView("noop", "127.0.0.1", True, dict(total), dict(total))])
