"""Script mode's outputs: what an unchanged script writes into its output directories, kept in the job's storage.

A script run in script mode (`workers.script`) writes checkpoints and other outputs into local directories of the
node it runs on. Those die with the Ray cluster, and a retry may land on other nodes, so `OutputSync` mirrors them
into `<outputs_uri>` (`<storage>/<job id>/outputs`) while the script runs, and `restore` brings them back before a
retry starts the script again. Each output root, a local directory, is mirrored to `<outputs_uri>/<name>`: `name`
is a relative posix path ("out", "runs/a"), or "" for the root itself (the SHUNTER_OUTPUT_DIR directory).

Inside a root:

- A direct subdirectory is a checkpoint dir (HF Trainer's `checkpoint-500`). A script gives no sign that one is fully
  written, so it counts as complete once a newer sibling exists (a larger trailing integer in a name of the same
  stem: `checkpoint-6` after `checkpoint-3`; names without digits compare by the newest mtime under them), once the
  caller says so (`mark_saved`, from HF Trainer's `on_save`), or when the script has exited (`stop(final=True)`).
  A complete dir is uploaded once, then sealed with shunter's manifest (`workers.manifest`), written last, so the
  one completeness rule (`manifest.check`) applies to it like to any checkpoint shunter writes. Changes to its files
  after that are ignored.
- A top-level file (the torchrun tutorial's `snapshot.pt`, rewritten every few epochs) is uploaded whenever it is
  stable (the same size and mtime on two scans in a row, or not modified for `QUIET_SECONDS`) and changed since its
  last upload, and at the end. It is a
  mirrored file, not a sealed checkpoint. Every node uploads its own; the same name from two nodes: the last
  upload wins.

A multi-node script writes each checkpoint dir partly on every node (each rank's RNG state, optimizer shards), so
sealing is a small protocol over storage, run by one `OutputSync` per node:

1. Each node uploads its own files of a complete dir, then writes its part listing
   `<dir>/.shunter-parts/node-<node rank>.json`: `{"node", "nodes", "attempt", "files": {path: {size, sha256}}}`.
   A node that has no such dir at all (only rank 0 writes it) writes an empty part as soon as another node's part
   of the same attempt appears.
2. The leader (the node of global rank 0) seals the dir once every node's part is there: it merges them (one path
   from two nodes with different sha256: not sealed, an error is logged) and writes `shunter-manifest.json` last;
   then it calls `on_checkpoint(uri, step)`, once per dir.
3. At the end each node (when there are several) writes `<outputs_uri>/.shunter-parts/final-node-<rank>.json`,
   after all its parts, naming the dirs it could not finish; a node that still has no part for a dir then has
   nothing in it. The leader waits for these markers, at most `final_wait` seconds, then gives up on what is left.

Parts and markers carry the shunter attempt when the caller gives one, and a part or marker of another attempt is
ignored: a retry does not seal a dir with a crashed attempt's leftovers. Without an attempt, leftovers of an earlier
run under the same `outputs_uri` are trusted (each node deletes its own old marker in `start`).

Uploads go to a temporary name moved into place where the filesystem can move (local, HDFS); an object store
(S3) shows an object only once its upload is complete, so there it is written directly, and a copy torn by a file
changing while it was read is replaced at a later scan. Nothing raises out of the background thread: failures are
logged, and the next scan retries.

Torch-free and Ray-free: stdlib, pyarrow, `workers.manifest` and `service.storage`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import posixpath
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyarrow import fs as pafs

from service.storage import filesystem_for, uri_of
from workers.manifest import FORMAT, MANIFEST, check

log = logging.getLogger(__name__)

PARTS = ".shunter-parts"  # per-dir part listings, and the final markers under <outputs_uri> itself
TMP_MARK = ".shunter-tmp-"  # in the name of every temporary file, here and on restore; never mirrored back
TRAINER_STATE = "trainer_state.json"  # HF Trainer's: `global_step` gives a step to a dir whose name has none
FINAL_WAIT = 60.0  # seconds the leader waits at the end for the other nodes' parts
QUIET_SECONDS = 0.5  # a top-level file not modified for this long is stable enough to upload
BLOCK = 1 << 20
_TRAILING = re.compile(r"\d+$")


def step_of(name: str) -> int | None:
    """The trailing integer of a dir name (`checkpoint-30` -> 30), None without one."""
    found = _TRAILING.search(name)
    return int(found.group()) if found else None


def storage_of(uri: str) -> tuple[str, Any]:
    """(path, pyarrow filesystem) of a storage URI: a local path, `s3://bucket/prefix`, or any URI pyarrow reads."""
    path, filesystem = filesystem_for(uri)
    if filesystem is None:
        if "://" in path:
            filesystem, path = pafs.FileSystem.from_uri(path)
        else:
            filesystem, path = pafs.LocalFileSystem(), os.path.abspath(path)
    return path.rstrip("/") or "/", filesystem


def _root_name(name: str) -> str:
    stripped = name.strip("/")
    normal = posixpath.normpath(stripped) if stripped else ""
    if normal == ".":
        return ""
    if normal == ".." or normal.startswith("../"):
        raise ValueError(f"output root name {name!r} leaves the outputs folder")
    return normal


def _join(base: str, name: str) -> str:
    return posixpath.join(base, name) if name else base


def _reserved(name: str, names: Iterable[str]) -> set[str]:
    """The children of root `name` in storage that belong to other roots ("" holds "out" when "out" is a root)."""
    reserved = set()
    for other in names:
        if other == name:
            continue
        if not name:
            reserved.add(other.split("/")[0])
        elif other.startswith(name + "/"):
            reserved.add(other[len(name) + 1 :].split("/")[0])
    return reserved


def _order(dirname: str) -> tuple[bool, int, str]:
    """Oldest first: dirs with a step by step, then those without one."""
    step = step_of(dirname)
    return (step is None, step or 0, dirname)


def _rank(manifest: dict[str, Any]) -> tuple[bool, int, float]:
    """Newest is largest: a dir with a step above one without, then by step, then by the manifest's time."""
    step = manifest.get("step")
    step = step if isinstance(step, int) and not isinstance(step, bool) else None
    stamp = manifest.get("time")
    return (step is not None, step or 0, float(stamp) if isinstance(stamp, (int, float)) else 0.0)


def _safe(rel: str) -> bool:
    """Whether a path from storage stays inside the dir it is restored into."""
    normal = posixpath.normpath(rel)
    return bool(rel) and not rel.startswith("/") and normal != ".." and not normal.startswith("../")


def _entries(root: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(root) as found:
            return sorted(found, key=lambda entry: entry.name)
    except (FileNotFoundError, NotADirectoryError):
        return []  # the script has not created it (yet)


def _children(filesystem: Any, path: str) -> list[pafs.FileInfo]:
    try:
        return filesystem.get_file_info(pafs.FileSelector(path, allow_not_found=True, recursive=False))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _read_json(filesystem: Any, path: str) -> Any:
    """The JSON document at `path`, None when there is none or it is not JSON."""
    if filesystem.get_file_info(path).type != pafs.FileType.File:
        return None
    with filesystem.open_input_stream(path) as stream:
        data = stream.read()
    try:
        return json.loads(data)
    except ValueError:
        log.warning("%s is not JSON; ignored", uri_of(path, filesystem))
        return None


def _listing(value: Any) -> dict[str, dict[str, Any]] | None:
    """A part's file listing, None when it is not one."""
    if not isinstance(value, dict) or not all(
        isinstance(entry, dict) and isinstance(entry.get("size"), int) and isinstance(entry.get("sha256"), str)
        for entry in value.values()
    ):
        return None
    return {rel: {"size": entry["size"], "sha256": entry["sha256"]} for rel, entry in value.items()}


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
        self._base, self._fs = storage_of(outputs_uri)
        # Object stores show an object only once it is whole; a move there is a copy and a delete.
        self._moves = getattr(self._fs, "type_name", "") in ("local", "hdfs")
        self._reserved = {name: self._reserved_of(name) for name in self.roots}
        self._dirs: dict[tuple[str, str], _Dir] = {}
        self._files: dict[tuple[str, str], _File] = {}
        self._settled: set[tuple[str, str]] = set()  # stored dirs found sealed: no adoption to consider
        self._markers: dict[int, dict[str, Any]] = {}
        self._made: set[str] = set()
        self._trouble: set[str] = set()
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
                self._fs.delete_file(self._marker_path(self.node_rank))  # an earlier run's, if any
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
                self._put(self._marker_path(self.node_rank), json.dumps(marker).encode())
            except OSError as exc:
                log.error("outputs: could not write %s (%s)", self._marker_path(self.node_rank), exc)

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
            dest = posixpath.join(self._stored(name), entry.name)
            try:
                uploaded = self._copy(Path(entry.path), dest, final=final)
            except OSError as exc:
                if not os.path.exists(entry.path):
                    continue  # deleted meanwhile: nothing to keep
                self._complain(dest, exc)
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
                    sealed = self._sealed_in_storage(name, dirname)
                except OSError as exc:
                    self._complain(self._stored(name, dirname), exc)
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
        stored = self._stored(state.name, state.dirname)
        complete = True
        for rel, local in _local_files(path).items():
            if rel in state.uploaded:
                continue
            dest = posixpath.join(stored, rel)
            try:
                uploaded = self._copy(local, dest, final=final)
            except OSError as exc:
                if not local.exists():
                    continue  # deleted meanwhile; if the whole dir went, it is dropped below
                self._complain(dest, exc)
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
            self._put(self._part_path(state, self.node_rank), json.dumps(part).encode())
        except OSError as exc:
            self._complain(stored, exc)
            return False
        state.part = True
        log.info("outputs: uploaded %d file(s) of %s", len(state.uploaded), uri_of(stored, self._fs))
        return True

    def _adopt(self, name: str, root: Path, final: bool) -> bool:
        """Write an empty part for each dir another node has a part of and this node has no files in."""
        if self.nodes == 1:
            return False
        reserved = self._reserved[name]
        for info in _children(self._fs, self._stored(name)):
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
            if self._fs.get_file_info(posixpath.join(info.path, MANIFEST)).type == pafs.FileType.File:
                self._settled.add(key)
                continue
            state = _Dir(name, dirname)
            others = [
                part.path
                for part in _children(self._fs, posixpath.join(info.path, PARTS))
                if part.base_name.startswith("node-") and part.base_name != f"node-{self.node_rank}.json"
            ]
            if not any(self._current(_read_json(self._fs, path)) for path in others):
                continue
            part = {"node": self.node_rank, "nodes": self.nodes, "attempt": self.attempt, "files": {}}
            self._put(self._part_path(state, self.node_rank), json.dumps(part).encode())
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
                self._complain(self._stored(state.name, state.dirname), exc)
                pending = True
        return pending

    def _seal(self, state: _Dir) -> bool:
        """Seal a dir whose parts are all in storage; True when sealed or given up."""
        stored = self._stored(state.name, state.dirname)
        state.parts[self.node_rank] = state.uploaded
        missing = []
        for node in range(self.nodes):
            if node in state.parts:
                continue
            marker = self._marker(node)  # read before the part: a node writes all its parts before its marker
            part = _read_json(self._fs, self._part_path(state, node))
            if self._current(part):
                files = _listing(part.get("files"))
                if files is None:
                    log.error("outputs: node %d's part of %s is malformed; not sealed", node, state.rel)
                    state.dropped = True
                    return True
                state.parts[node] = files
            elif marker is not None:
                if state.rel in marker.get("unfinished", ()):
                    log.error("outputs: node %d could not upload its files of %s; not sealed", node, state.rel)
                    state.dropped = True
                    return True
                state.parts[node] = {}  # that node finished without any file in it
            else:
                missing.append(node)
        if missing:
            log.debug("outputs: %s waits for the parts of node(s) %s", state.rel, missing)
            return False
        merged: dict[str, dict[str, Any]] = {}
        for node, files in sorted(state.parts.items()):
            for rel, entry in files.items():
                if rel in merged and merged[rel]["sha256"] != entry["sha256"]:
                    log.error(
                        "outputs: nodes wrote different contents to %s/%s (node %d's differs); not sealed",
                        state.rel,
                        rel,
                        node,
                    )
                    state.dropped = True
                    return True
                merged[rel] = entry
        step = step_of(state.dirname)
        if step is None and TRAINER_STATE in merged:
            trainer_state = _read_json(self._fs, posixpath.join(stored, TRAINER_STATE))
            global_step = trainer_state.get("global_step") if isinstance(trainer_state, dict) else None
            step = global_step if isinstance(global_step, int) else None
        manifest: dict[str, Any] = {"format": FORMAT, "step": step, "epoch": 0, "time": time.time(), "files": merged}
        if self.attempt is not None:
            manifest["attempt"] = self.attempt
        self._put(posixpath.join(stored, MANIFEST), json.dumps(manifest, indent=1).encode())
        state.sealed = True
        uri = uri_of(stored, self._fs)
        log.info("outputs: sealed %s (step %s, %d file(s))", uri, step, len(merged))
        if self.on_checkpoint is not None:
            try:
                self.on_checkpoint(uri, step)
            except Exception:
                log.exception("outputs: on_checkpoint(%s, %s) failed", uri, step)
        return True

    # -- storage

    def _stored(self, name: str, dirname: str = "") -> str:
        return _join(_join(self._base, name), dirname)

    def _part_path(self, state: _Dir, node: int) -> str:
        return posixpath.join(self._stored(state.name, state.dirname), PARTS, f"node-{node}.json")

    def _marker_path(self, node: int) -> str:
        return posixpath.join(self._base, PARTS, f"final-node-{node}.json")

    def _current(self, document: Any) -> bool:
        """Whether a part or marker is this run's (of this attempt, when one is given)."""
        return isinstance(document, dict) and (self.attempt is None or document.get("attempt") == self.attempt)

    def _marker(self, node: int) -> dict[str, Any] | None:
        if node not in self._markers:
            marker = _read_json(self._fs, self._marker_path(node))
            if not self._current(marker):
                return None
            self._markers[node] = marker
        return self._markers[node]

    def _others_done(self) -> bool:
        """Whether every other node has written its final marker (the leader waits for them; others do not)."""
        if not self.leader:
            return True
        try:
            return all(self._marker(node) is not None for node in range(self.nodes) if node != self.node_rank)
        except OSError as exc:
            self._complain(self._marker_path(0), exc)
            return False

    def _waiting(self, state: _Dir) -> bool:
        if state.dropped or state.sealed:
            return False
        return not state.part or self.leader

    def _sealed_in_storage(self, name: str, dirname: str) -> bool:
        verdict = check(self._stored(name, dirname), self._fs)
        return verdict.complete and verdict.manifest is not None

    def _ensure_dir(self, path: str) -> None:
        if path not in self._made:
            self._fs.create_dir(path, recursive=True)
            self._made.add(path)

    def _target(self, dest: str) -> str:
        if not self._moves:
            return dest
        folder, base = posixpath.split(dest)
        return posixpath.join(folder, f".{base}{TMP_MARK}{uuid.uuid4().hex[:8]}")

    def _put(self, dest: str, data: bytes) -> None:
        """Write `data` to `dest` in storage, whole or not at all."""
        try:
            self._ensure_dir(posixpath.dirname(dest))
            target = self._target(dest)
            with self._fs.open_output_stream(target) as out:
                out.write(data)
            if target != dest:
                self._fs.move(target, dest)
        except OSError:
            self._made.clear()  # perhaps a folder went away under us: make them again
            raise
        self._trouble.discard(dest)

    def _copy(self, local: Path, dest: str, *, final: bool) -> dict[str, Any] | None:
        """Upload a local file; its size and sha256, or None when it changed while it was read (unless `final`)."""
        before = local.stat()
        target = dest
        try:
            self._ensure_dir(posixpath.dirname(dest))
            target = self._target(dest)
            digest, size = hashlib.sha256(), 0
            with local.open("rb") as source, self._fs.open_output_stream(target) as out:
                while block := source.read(BLOCK):
                    digest.update(block)
                    out.write(block)
                    size += len(block)
            after = local.stat()
            if not final and not (before.st_size == after.st_size == size and before.st_mtime_ns == after.st_mtime_ns):
                log.info("outputs: %s changed while it was uploaded; again at the next scan", local)
                self._discard(target, dest)
                return None
            if target != dest:
                self._fs.move(target, dest)
        except BaseException:
            self._discard(target, dest)
            self._made.clear()
            raise
        self._trouble.discard(dest)
        return {"size": size, "sha256": digest.hexdigest()}

    def _discard(self, target: str, dest: str) -> None:
        if target != dest:
            with contextlib.suppress(OSError):
                self._fs.delete_file(target)

    def _complain(self, where: str, exc: BaseException) -> None:
        """Log a storage failure: a warning the first time for a path, then quietly until it succeeds."""
        level = logging.DEBUG if where in self._trouble else logging.WARNING
        self._trouble.add(where)
        log.log(level, "outputs: %s failed (%s); retrying at the next scan", uri_of(where, self._fs), exc)

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


def _local_files(directory: Path) -> dict[str, Path]:
    """Every file under a local dir, by relative posix path: no manifest, no temporary files, no parts."""
    files = {}
    for folder, subdirs, names in os.walk(directory):
        subdirs[:] = sorted(d for d in subdirs if d != PARTS)
        for name in sorted(names):
            if name == MANIFEST or TMP_MARK in name:
                continue
            path = Path(folder) / name
            files[path.relative_to(directory).as_posix()] = path
    return files


def _tree_mtime(directory: Path) -> int:
    """The newest mtime (ns) of a dir and everything under it."""
    newest = 0
    with contextlib.suppress(OSError):
        newest = directory.stat().st_mtime_ns
    for folder, subdirs, names in os.walk(directory):
        for name in [*subdirs, *names]:
            with contextlib.suppress(OSError):
                newest = max(newest, (Path(folder) / name).stat().st_mtime_ns)
    return newest


def _download(filesystem: Any, source: str, dest: Path, size: int | None) -> None:
    """Copy a stored file to a local path, unless a file of that size is there already (the same node again)."""
    if size is not None and dest.is_file() and dest.stat().st_size == size:
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}{TMP_MARK}{uuid.uuid4().hex[:8]}")
    try:
        with filesystem.open_input_stream(source) as stream, tmp.open("wb") as out:
            while block := stream.read(BLOCK):
                out.write(block)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def restore(outputs_uri: str, roots: Mapping[str, Path]) -> Path | None:
    """Download into each local root what storage holds for it: its top-level files and every complete (sealed)
    checkpoint dir. A local file of the same size is left alone. Returns the local path of the newest complete
    checkpoint dir over all roots (largest step, then the manifest's time), None when there is none. Raises
    OSError when storage cannot be read: a retry must not start from scratch silently."""
    base, filesystem = storage_of(outputs_uri)
    named = {_root_name(name): Path(path) for name, path in roots.items()}
    best: tuple[tuple[bool, int, float], Path] | None = None
    for name, root in named.items():
        reserved = _reserved(name, named)
        for info in _children(filesystem, _join(base, name)):
            child = info.base_name
            if child in reserved or child == PARTS or TMP_MARK in child:
                continue
            if info.type == pafs.FileType.File:
                _download(filesystem, info.path, root / child, info.size)
                continue
            if info.type != pafs.FileType.Directory:
                continue
            verdict = check(info.path, filesystem)
            if not verdict.complete or verdict.manifest is None:
                log.info("outputs: %s is not a sealed checkpoint; not restored", uri_of(info.path, filesystem))
                continue
            for rel, entry in verdict.manifest["files"].items():
                if not _safe(rel):
                    log.warning("outputs: %s lists %r, outside itself; skipped", uri_of(info.path, filesystem), rel)
                    continue
                _download(filesystem, posixpath.join(info.path, rel), root / child / rel, entry["size"])
            _download(filesystem, posixpath.join(info.path, MANIFEST), root / child / MANIFEST, None)
            rank = _rank(verdict.manifest)
            if best is None or rank > best[0]:
                best = (rank, root / child)
    return best[1] if best else None


def latest_checkpoint(outputs_uri: str) -> tuple[str, int | None] | None:
    """(URI, step) of the newest complete checkpoint dir under `outputs_uri` (in `restore`'s order), None when
    there is none. Reads manifests only."""
    base, filesystem = storage_of(outputs_uri)
    best: tuple[tuple[bool, int, float], str, Any] | None = None
    found = filesystem.get_file_info(pafs.FileSelector(base, allow_not_found=True, recursive=True))
    for info in found:
        if info.type != pafs.FileType.File or info.base_name != MANIFEST:
            continue
        directory = posixpath.dirname(info.path)
        if PARTS in directory.split("/"):
            continue
        verdict = check(directory, filesystem)
        if not verdict.complete or verdict.manifest is None:
            continue
        rank = _rank(verdict.manifest)
        if best is None or rank > best[0]:
            best = (rank, directory, verdict.manifest.get("step"))
    if best is None:
        return None
    step = best[2] if isinstance(best[2], int) and not isinstance(best[2], bool) else None
    return uri_of(best[1], filesystem), step
