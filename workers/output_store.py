"""Where script mode's outputs go in storage (`workers.output_sync` writes there, `workers.outputs` reads back):
the paths of roots, dirs, parts and final markers under `<outputs_uri>`, and writes that land whole or not at all.
Failures are logged once per path (`complain`) and raised to the scan, which retries at the next one."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import posixpath
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.core.locations import uri_of
from workers.manifest import check
from workers.outputs import BLOCK, PARTS, TMP_MARK, _join, _read_json, storage_of

log = logging.getLogger("workers.outputs")  # one logger for the feature: its messages read as one story


@dataclass
class _Dir:
    """What this node did for one checkpoint dir of a root."""

    name: str  # the root's name
    dirname: str
    uploaded: dict[str, dict[str, Any]] = field(default_factory=dict)  # this node's files in storage
    part: bool = False  # this node's part listing is in storage
    sealed: bool = False  # the manifest is in storage (leader), or was there already
    dropped: bool = False  # given up: vanished mid-upload, conflicting parts, a node that could not finish
    parts: dict[int, dict[str, dict[str, Any]]] = field(default_factory=dict)  # leader: the listings read so far

    @property
    def rel(self) -> str:
        return _join(self.name, self.dirname)


class OutputStore:
    """One node's view of `outputs_uri`. `attempt`: parts and markers of another attempt are not this run's."""

    def __init__(self, outputs_uri: str, attempt: int | None) -> None:
        self.attempt = attempt
        self.base, self.fs = storage_of(outputs_uri)
        # Object stores show an object only once it is whole; a move there is a copy and a delete.
        self.moves = getattr(self.fs, "type_name", "") in ("local", "hdfs")
        self._markers: dict[int, dict[str, Any]] = {}
        self._made: set[str] = set()
        self._trouble: set[str] = set()

    def stored(self, name: str, dirname: str = "") -> str:
        return _join(_join(self.base, name), dirname)

    def part_path(self, name: str, dirname: str, node: int) -> str:
        return posixpath.join(self.stored(name, dirname), PARTS, f"node-{node}.json")

    def marker_path(self, node: int) -> str:
        return posixpath.join(self.base, PARTS, f"final-node-{node}.json")

    def current(self, document: Any) -> bool:
        """Whether a part or marker is this run's (of this attempt, when one is given)."""
        return isinstance(document, dict) and (self.attempt is None or document.get("attempt") == self.attempt)

    def marker(self, node: int) -> dict[str, Any] | None:
        if node not in self._markers:
            marker = _read_json(self.fs, self.marker_path(node))
            if not self.current(marker):
                return None
            self._markers[node] = marker
        return self._markers[node]

    def sealed_in_storage(self, name: str, dirname: str) -> bool:
        verdict = check(self.stored(name, dirname), self.fs)
        return verdict.complete and verdict.manifest is not None

    def ensure_dir(self, path: str) -> None:
        if path not in self._made:
            self.fs.create_dir(path, recursive=True)
            self._made.add(path)

    def target(self, dest: str) -> str:
        if not self.moves:
            return dest
        folder, base = posixpath.split(dest)
        return posixpath.join(folder, f".{base}{TMP_MARK}{uuid.uuid4().hex[:8]}")

    def put(self, dest: str, data: bytes) -> None:
        """Write `data` to `dest` in storage, whole or not at all."""
        try:
            self.ensure_dir(posixpath.dirname(dest))
            target = self.target(dest)
            with self.fs.open_output_stream(target) as out:
                out.write(data)
            if target != dest:
                self.fs.move(target, dest)
        except OSError:
            self._made.clear()  # perhaps a folder went away under us: make them again
            raise
        self._trouble.discard(dest)

    def copy(self, local: Path, dest: str, *, final: bool) -> dict[str, Any] | None:
        """Upload a local file; its size and sha256, or None when it changed while it was read (unless `final`)."""
        before = local.stat()
        target = dest
        try:
            self.ensure_dir(posixpath.dirname(dest))
            target = self.target(dest)
            digest, size = hashlib.sha256(), 0
            with local.open("rb") as source, self.fs.open_output_stream(target) as out:
                while block := source.read(BLOCK):
                    digest.update(block)
                    out.write(block)
                    size += len(block)
            after = local.stat()
            if not final and not (before.st_size == after.st_size == size and before.st_mtime_ns == after.st_mtime_ns):
                log.info("outputs: %s changed while it was uploaded; again at the next scan", local)
                self.discard(target, dest)
                return None
            if target != dest:
                self.fs.move(target, dest)
        except BaseException:
            self.discard(target, dest)
            self._made.clear()
            raise
        self._trouble.discard(dest)
        return {"size": size, "sha256": digest.hexdigest()}

    def discard(self, target: str, dest: str) -> None:
        if target != dest:
            with contextlib.suppress(OSError):
                self.fs.delete_file(target)

    def complain(self, where: str, exc: BaseException) -> None:
        """Log a storage failure: a warning the first time for a path, then quietly until it succeeds."""
        level = logging.DEBUG if where in self._trouble else logging.WARNING
        self._trouble.add(where)
        log.log(level, "outputs: %s failed (%s); retrying at the next scan", uri_of(where, self.fs), exc)
