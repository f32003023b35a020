"""Script mode's outputs: what an unchanged script writes into its output directories, kept in the job's storage.

A script run in script mode (`workers.script`) writes checkpoints and other outputs into local directories of the
node it runs on. Those die with the Ray cluster, and a retry may land on other nodes, so `OutputSync`
(`workers.output_sync`) mirrors them into `<outputs_uri>` (`<storage>/<job id>/outputs`) while the script runs, and
`restore` brings them back before a retry starts the script again. Each output root, a local directory, is mirrored
to `<outputs_uri>/<name>`: `name` is a relative posix path ("out", "runs/a"), or "" for the root itself (the
SHUNTER_OUTPUT_DIR directory).

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

Torch-free and Ray-free: stdlib, pyarrow, `workers.manifest` and `service.core.locations`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import re
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pyarrow import fs as pafs

from service.core.locations import filesystem_for, uri_of
from workers.manifest import MANIFEST, check

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
