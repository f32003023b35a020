"""Files the dispatcher writes on its own host or in checkpoint storage while handling a job: the kept copy of an
attempt's driver log, and preemption notices.

These are shunter's own effects, not the job's: a failure here (a full disk, an unwritable data dir, storage that
cannot be reached) raises `HostFault`, which the dispatcher records as an event and gets past; it never fails the job.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable
from pathlib import Path

from service.core import locations
from service.store.models import utcnow


class HostFault(Exception):
    """shunter's host or storage failed at something it does for a job; the job itself is not at fault."""


class HostFiles:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir.resolve()

    def log_path(self, job_id: str, attempt: int) -> Path:
        """Where an attempt's log is kept. Built here from ids, never read from a row."""
        return self.data_dir / "logs" / job_id / f"attempt-{attempt}.log"

    def keep_log(self, job_id: str, attempt: int, text: str) -> str:
        """Store an ended attempt's driver log, so it stays readable after Ray forgets the job; returns its path."""
        path = self.log_path(job_id, attempt)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.replace(path)
        except (OSError, ValueError) as exc:
            raise HostFault(f"could not keep the log of attempt {attempt}: {exc}") from exc
        return str(path)

    def keep_log_chunks(self, job_id: str, attempt: int, chunks: Iterable[bytes]) -> str:
        """`keep_log` of a log read a chunk at a time (Ray's, by range), written as it comes: whatever the log's size,
        one chunk is held. A read that breaks off (`InfraError`) leaves no copy, nor a partial one."""
        path = self.log_path(job_id, attempt)
        tmp = path.with_suffix(".tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as out:
                for chunk in chunks:
                    out.write(chunk)
            tmp.replace(path)
        except (OSError, ValueError) as exc:
            raise HostFault(f"could not keep the log of attempt {attempt}: {exc}") from exc
        finally:
            with contextlib.suppress(OSError):  # gone already once it replaced the copy; left by a failure otherwise
                tmp.unlink(missing_ok=True)
        return str(path)

    def write_preemption_notice(self, storage_uri: str, job_id: str, *, attempt: int) -> None:
        """Drop the marker the job's workers poll for (workers.preemption): they checkpoint at once when they see it.
        It names the attempt asked, so that one left behind never stops a later attempt."""
        body = json.dumps({"at": utcnow().isoformat(), "attempt": attempt})
        try:
            path, fs = locations.preemption_marker(storage_uri, job_id)
            if fs is None:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                Path(path).write_text(body)
            else:
                with fs.open_output_stream(path) as out:
                    out.write(body.encode())
        except Exception as exc:  # noqa: BLE001 - pyarrow raises its own types for unreachable or malformed storage
            raise HostFault(f"could not write the preemption notice: {exc}") from exc

    def clear_preemption_notice(self, storage_uri: str, job_id: str) -> None:
        try:
            path, fs = locations.preemption_marker(storage_uri, job_id)
            if fs is None:
                Path(path).unlink(missing_ok=True)
            else:
                fs.delete_file(path)
        except FileNotFoundError:
            return
        except Exception as exc:  # noqa: BLE001 - as above
            raise HostFault(f"could not remove the preemption notice: {exc}") from exc
