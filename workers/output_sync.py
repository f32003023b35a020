"""Script mode's outputs mirrored into storage while the script runs: one `OutputSync` per node, sealing checkpoint
dirs with the other nodes by the protocol `workers.outputs` describes. Storage paths and whole writes are
`workers.output_store`'s. Nothing raises out of the background thread: failures are logged, and the next scan
retries."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyarrow import fs as pafs

from service.core.locations import uri_of
from workers.manifest import MANIFEST
from workers.output_seal import seal
from workers.output_store import OutputStore, _Dir
from workers.outputs import (
    FINAL_WAIT,
    PARTS,
    QUIET_SECONDS,
    TMP_MARK,
    _children,
    _entries,
    _local_files,
    _order,
    _read_json,
    _reserved,
    _root_name,
    _tree_mtime,
    step_of,
)  # fmt: skip

log = logging.getLogger("workers.outputs")  # one logger for the feature: its messages read as one story


@dataclass
class _File:
    """A top-level file of a root: (size, mtime_ns) at the last scan and at its last upload."""

    seen: tuple[int, int] | None = None
    uploaded: tuple[int, int] | None = None


class OutputSync:
    """Mirrors local output roots into `outputs_uri` while the script runs; one per node (see the module doc).

    `roots`: output name -> local directory. `node_rank`/`nodes`: this node and how many write parts of each
    checkpoint dir. `leader`: this node seals dirs and calls `on_checkpoint(uri, step)`. `attempt`: the shunter
    attempt, written into manifests and parts. `interval`: seconds between scans of the thread. `final_wait`: how
    long `stop(final=True)` keeps retrying what is left (the leader: waiting for the other nodes).
    """

    def __init__(
        self,
        roots: Mapping[str, Path],
        outputs_uri: str,
        *,
        node_rank: int = 0,
        nodes: int = 1,
        leader: bool = True,
        attempt: int | None = None,
        on_checkpoint: Callable[[str, int | None], None] | None = None,
        interval: float = 2.0,
        final_wait: float = FINAL_WAIT,
    ) -> None:
        self.roots = {_root_name(name): Path(path) for name, path in roots.items()}
        self.outputs_uri = outputs_uri
        self.node_rank, self.nodes, self.leader, self.attempt = node_rank, max(1, nodes), leader, attempt
        self.on_checkpoint, self.interval, self.final_wait = on_checkpoint, interval, final_wait
        self.store = OutputStore(outputs_uri, attempt)
        self._reserved = {name: self._reserved_of(name) for name in self.roots}
        self._dirs: dict[tuple[str, str], _Dir] = {}
        self._files: dict[tuple[str, str], _File] = {}
        self._settled: set[tuple[str, str]] = set()  # stored dirs found sealed: no adoption to consider
        self._marked: set[tuple[str, str]] = set()
        self._marks_lock = threading.Lock()
        self._scan_lock = threading.Lock()
        self._restless = False  # the last scan left a top-level file that had not rested (see `_loop`)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the caller's side

    def start(self) -> None:
        """Scan every `interval` seconds in a daemon thread until `stop`."""
        if self._thread is not None:
            return
        if self.nodes > 1:
            with contextlib.suppress(OSError):
                self.store.fs.delete_file(self.store.marker_path(self.node_rank))  # an earlier run's, if any
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="shunter-output-sync", daemon=True)
        self._thread.start()

    def mark_saved(self, path: str | Path) -> None:
        """The script says the checkpoint dir at `path` is fully written: it is sealed at the next scan."""
        target = Path(os.path.realpath(path))
        for name, root in self.roots.items():
            if Path(os.path.realpath(root)) == target.parent:
                with self._marks_lock:
                    self._marked.add((name, target.name))
                return
        log.warning("%s is not a directory directly under an output root; not marked", path)

    def stop(self, final: bool = True) -> None:
        """Stop the thread; with `final` (the script exited) scan once more with every checkpoint dir complete."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if not final:
            return
        deadline = time.monotonic() + self.final_wait
        while True:
            others = self._others_done()  # before the scan: their markers come after all their parts
            settled = self.scan(final=True)
            if settled and others:
                break
            if time.monotonic() >= deadline:
                left = sorted(state.rel for state in self._dirs.values() if self._waiting(state))
                log.warning(
                    "outputs: gave up after %.0f s; not sealed or not uploaded: %s%s",
                    self.final_wait,
                    ", ".join(left) or "top-level files",
                    "" if others else " (another node never finished)",
                )
                break
            time.sleep(max(0.05, min(self.interval, 1.0)))
        if self.nodes > 1:
            unfinished = sorted(state.rel for state in self._dirs.values() if not state.part)
            marker = {"node": self.node_rank, "attempt": self.attempt, "time": time.time(), "unfinished": unfinished}
            try:
                self.store.put(self.store.marker_path(self.node_rank), json.dumps(marker).encode())
            except OSError as exc:
                log.error("outputs: could not write %s (%s)", self.store.marker_path(self.node_rank), exc)

    def scan(self, final: bool = False) -> bool:
        """One pass over every root; True when nothing is left to upload or seal. Never raises."""
        with self._scan_lock:
            pending = self._restless = False
            for name, root in self.roots.items():
                for phase in (self._scan_files, self._scan_dirs, self._adopt):
                    try:
                        pending |= phase(name, root, final)
                    except Exception:
                        log.exception("outputs: scanning %s (%s) failed; retrying at the next scan", root, name)
                        pending = True
            if self.leader:
                try:
                    pending |= self._seal_all()
                except Exception:
                    log.exception("outputs: sealing failed; retrying at the next scan")
                    pending = True
            return not pending

    # -- a scan's steps

    def _loop(self) -> None:
        wait = self.interval
        while not self._stop.wait(wait):
            self.scan()
            # A top-level file found changed but not at rest is looked at again once it can be (QUIET_SECONDS on),
            # not a whole interval later. A file rewritten as often as the scans run, a little before each (the
            # torchrun tutorial's snapshot every 2 s under the 2 s scan), is otherwise never at rest at a scan and
            # reaches storage only when the script ends: CI saw the snapshot of test_script_jobs kept that late.
            wait = min(self.interval, QUIET_SECONDS * 1.5) if self._restless else self.interval

    def _scan_files(self, name: str, root: Path, final: bool) -> bool:
        pending = False
        for entry in _entries(root):
            if TMP_MARK in entry.name or not entry.is_file():
                continue
            stat = entry.stat()
            stamp = (stat.st_size, stat.st_mtime_ns)
            state = self._files.setdefault((name, entry.name), _File())
            # Stable: unchanged since the last scan, or untouched for QUIET_SECONDS (a file rewritten as often as
            # the scans run is never the same on two of them; the copy is checked for a change while read anyway).
            quiet = time.time_ns() - stat.st_mtime_ns >= QUIET_SECONDS * 1e9
            stable, state.seen = state.seen == stamp or quiet, stamp
            if stamp == state.uploaded:
                continue
            if not (stable or final):
                pending = self._restless = True
                continue
            dest = posixpath.join(self.store.stored(name), entry.name)
            try:
                uploaded = self.store.copy(Path(entry.path), dest, final=final)
            except OSError as exc:
                if not os.path.exists(entry.path):
                    continue  # deleted meanwhile: nothing to keep
                self.store.complain(dest, exc)
                pending = True
                continue
            if uploaded is None:
                pending = True
            else:
                state.uploaded = stamp
        return pending

    def _scan_dirs(self, name: str, root: Path, final: bool) -> bool:
        reserved = self._reserved[name]
        dirs = {
            entry.name: Path(entry.path)
            for entry in _entries(root)
            if entry.is_dir() and entry.name not in reserved and entry.name != PARTS
        }
        with self._marks_lock:
            marked = {dirname for root_name, dirname in self._marked if root_name == name}
        mtimes: dict[str, int] = {}
        pending = False
        for dirname in sorted(dirs, key=_order):
            key = (name, dirname)
            state = self._dirs.get(key)
            if state is not None and (state.part or state.dropped):
                continue
            # Once its upload began it goes on, even if the newer sibling that made it complete is deleted.
            if state is None and not (final or dirname in marked or self._newer_sibling(dirname, dirs, mtimes)):
                continue
            if state is None:
                try:
                    sealed = self.store.sealed_in_storage(name, dirname)
                except OSError as exc:
                    self.store.complain(self.store.stored(name, dirname), exc)
                    pending = True
                    continue
                state = self._dirs[key] = _Dir(name, dirname)
                if sealed:  # an earlier attempt sealed it (and `restore` brought it back): nothing to do
                    state.part = state.sealed = True
                    continue
            pending |= not self._upload_dir(state, dirs[dirname], final)
        for state in self._dirs.values():
            if state.name == name and not (state.part or state.dropped) and state.dirname not in dirs:
                log.warning("outputs: %s vanished before it was uploaded; not sealed", root / state.dirname)
                state.dropped = True
        return pending

    def _newer_sibling(self, dirname: str, dirs: Mapping[str, Path], mtimes: dict[str, int]) -> bool:
        step = step_of(dirname)
        if step is not None:
            stem = dirname.rstrip("0123456789")
            return any(
                other.startswith(stem) and other[len(stem) :].isdigit() and int(other[len(stem) :]) > step
                for other in dirs
            )

        def mtime(other: str) -> int:
            if other not in mtimes:
                mtimes[other] = _tree_mtime(dirs[other])
            return mtimes[other]

        return any(other != dirname and step_of(other) is None and mtime(other) > mtime(dirname) for other in dirs)

    def _upload_dir(self, state: _Dir, path: Path, final: bool) -> bool:
        """Upload this node's files of a complete dir, then its part listing; True when done."""
        stored = self.store.stored(state.name, state.dirname)
        complete = True
        for rel, local in _local_files(path).items():
            if rel in state.uploaded:
                continue
            dest = posixpath.join(stored, rel)
            try:
                uploaded = self.store.copy(local, dest, final=final)
            except OSError as exc:
                if not local.exists():
                    continue  # deleted meanwhile; if the whole dir went, it is dropped below
                self.store.complain(dest, exc)
                return False
            if uploaded is None:
                complete = False  # changed while it was read: again at the next scan
            else:
                state.uploaded[rel] = uploaded
        if not path.is_dir():
            log.warning("outputs: %s vanished while it was uploaded; not sealed", path)
            state.dropped = True
            return True
        if not complete:
            return False
        part = {"node": self.node_rank, "nodes": self.nodes, "attempt": self.attempt, "files": state.uploaded}
        try:
            self.store.put(self.store.part_path(state.name, state.dirname, self.node_rank), json.dumps(part).encode())
        except OSError as exc:
            self.store.complain(stored, exc)
            return False
        state.part = True
        log.info("outputs: uploaded %d file(s) of %s", len(state.uploaded), uri_of(stored, self.store.fs))
        return True

    def _adopt(self, name: str, root: Path, final: bool) -> bool:
        """Write an empty part for each dir another node has a part of and this node has no files in."""
        if self.nodes == 1:
            return False
        reserved = self._reserved[name]
        for info in _children(self.store.fs, self.store.stored(name)):
            dirname, key = info.base_name, (name, info.base_name)
            if (
                info.type != pafs.FileType.Directory
                or dirname == PARTS
                or dirname in reserved
                or key in self._dirs
                or key in self._settled
                or (root / dirname).exists()
            ):
                continue
            if self.store.fs.get_file_info(posixpath.join(info.path, MANIFEST)).type == pafs.FileType.File:
                self._settled.add(key)
                continue
            state = _Dir(name, dirname)
            others = [
                part.path
                for part in _children(self.store.fs, posixpath.join(info.path, PARTS))
                if part.base_name.startswith("node-") and part.base_name != f"node-{self.node_rank}.json"
            ]
            if not any(self.store.current(_read_json(self.store.fs, path)) for path in others):
                continue
            part: dict[str, Any] = {"node": self.node_rank, "nodes": self.nodes, "attempt": self.attempt, "files": {}}
            self.store.put(self.store.part_path(state.name, state.dirname, self.node_rank), json.dumps(part).encode())
            state.part = True
            self._dirs[key] = state
            log.info("outputs: this node has no files in %s; wrote its empty part", state.rel)
        return False

    def _seal_all(self) -> bool:
        pending = False
        for state in sorted(self._dirs.values(), key=lambda s: (_order(s.dirname), s.name)):
            if not self._waiting(state) or not state.part:
                continue
            try:
                pending |= not self._seal(state)
            except OSError as exc:
                self.store.complain(self.store.stored(state.name, state.dirname), exc)
                pending = True
        return pending

    def _seal(self, state: _Dir) -> bool:
        """Seal a dir whose parts are all in storage; True when sealed or given up (`workers.output_seal`)."""
        return seal(self.store, state, node_rank=self.node_rank, nodes=self.nodes, on_checkpoint=self.on_checkpoint)

    def _others_done(self) -> bool:
        """Whether every other node has written its final marker (the leader waits for them; others do not)."""
        if not self.leader:
            return True
        try:
            return all(self.store.marker(node) is not None for node in range(self.nodes) if node != self.node_rank)
        except OSError as exc:
            self.store.complain(self.store.marker_path(0), exc)
            return False

    def _waiting(self, state: _Dir) -> bool:
        if state.dropped or state.sealed:
            return False
        return not state.part or self.leader

    def _reserved_of(self, name: str) -> set[str]:
        """Children of a root that are other roots: by name in storage, by path on this node."""
        reserved = _reserved(name, self.roots)
        here = Path(os.path.realpath(self.roots[name]))
        for other, path in self.roots.items():
            if other == name:
                continue
            with contextlib.suppress(ValueError):
                inner = Path(os.path.realpath(path)).relative_to(here)
                if inner.parts:
                    reserved.add(inner.parts[0])
        return reserved
