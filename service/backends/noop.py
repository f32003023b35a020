"""A stand-in for Ray that "runs" every job instantly: for draining thousands of claims in stress tests and benchmarks
of the queue, where Ray's ~10 s per job would only hide what the database does.

It implements the Ray adapter's interface for real, across processes: each submission is a file created with O_EXCL
in a shared directory, so a second submission of one id fails exactly as Ray refuses it, and every submission call
is appended to `submits.log` (id, pid, created or refused) so a test can count them. A job runs for `run_seconds`
after its submission (then SUCCEEDED) unless stopped (then STOPPED). It stands in for Ray only where Ray's behaviour
is not what is tested (queue scale, and faults injected into the dispatcher's own effects); never in a test of
training, placement or of how Ray's own failures are handled.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from service.core.backend import SUBMISSION_PREFIX, ClusterView, LogPiece, NodeView, RayJobInfo, chunks_of, piece_of
from service.core.errors import InfraError

STOPPED = ".stopped"  # beside a submission's file: it was stopped
FAILED = ".failed"  # beside a submission's file: its Ray Job ended FAILED (fault injection: `fail`)


class NoopJobs:
    """The `Backend` protocol without Ray."""

    dashboard_url = "noop://"
    gcs_address = None

    def __init__(self, directory: str | Path, *, cpus: float = 1e9, run_seconds: float = 0.0) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cpus = cpus
        self.run_seconds = run_seconds  # how long a job stays RUNNING after its submission (0: it ends at once)
        self.requested: list[dict[str, float]] | None = None  # the last request for room (request_resources)

    def close(self) -> None:
        pass

    def ping(self) -> bool:
        return self.problem() is None

    def problem(self) -> str | None:
        return None if self.dir.is_dir() else f"noop backend directory {self.dir} is gone"

    def info(self, submission_id: str) -> RayJobInfo | None:
        path = self.dir / submission_id
        try:
            submitted = path.stat().st_mtime
        except FileNotFoundError:
            return None
        if (self.dir / f"{submission_id}{STOPPED}").exists():
            return RayJobInfo(submission_id, "STOPPED", message="stopped")
        if (self.dir / f"{submission_id}{FAILED}").exists():
            return RayJobInfo(submission_id, "FAILED", message="failed")
        if time.time() - submitted < self.run_seconds:
            return RayJobInfo(submission_id, "RUNNING")
        return RayJobInfo(submission_id, "SUCCEEDED")

    def submit(
        self, *, submission_id: str, entrypoint: str, runtime_env: dict[str, Any], metadata: dict[str, str]
    ) -> bool:
        try:
            fd = os.open(self.dir / submission_id, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            self._log(submission_id, "refused")
            return False  # adopted, as RayJobs.submit does when the id exists
        except OSError as exc:
            raise InfraError(f"noop backend: {exc}") from exc
        os.close(fd)
        self._log(submission_id, "created")
        return True

    def _log(self, submission_id: str, outcome: str) -> None:
        with open(self.dir / "submits.log", "a") as log:
            log.write(f"{submission_id} {os.getpid()} {outcome}\n")

    def stop(self, submission_id: str) -> bool:
        info = self.info(submission_id)
        if info is None or info.is_terminal:
            return False
        (self.dir / f"{submission_id}{STOPPED}").touch()
        return True

    def fail(self, submission_id: str) -> None:
        """Tests: the job's Ray Job ends FAILED from now on (its driver exited non-zero)."""
        (self.dir / f"{submission_id}{FAILED}").touch()

    def logs(self, submission_id: str) -> str | None:
        return f"noop job {submission_id}\n" if (self.dir / submission_id).exists() else None

    def log_range(self, submission_id: str, start: int, length: int) -> LogPiece | None:
        return piece_of(self.logs(submission_id), start, length)

    def log_stream(self, submission_id: str, start: int, end: int | None) -> Iterator[bytes] | None:
        return chunks_of(self.logs(submission_id), start, end)

    def dump_stacks(self, submission_id: str, *, dump_id: str) -> str:
        return "the noop backend runs no code: there are no stacks to dump"

    def list_submission_ids(self, prefix: str = SUBMISSION_PREFIX) -> list[str]:
        marks = (STOPPED, FAILED)
        return sorted(p.name for p in self.dir.iterdir() if p.name.startswith(prefix) and not p.name.endswith(marks))

    def request_resources(self, bundles: list[dict[str, float]]) -> None:
        """Kept, not acted on: the noop cluster never grows (it has room for everything)."""
        self.requested = [dict(b) for b in bundles]

    def cluster(self) -> ClusterView:
        total = {"CPU": self.cpus, "GPU": 0.0, "memory": 1e15}
        return ClusterView(nodes=[NodeView("noop", "127.0.0.1", True, dict(total), dict(total))])
