"""shunter's checkpoint manifest, and the one rule for whether a checkpoint is complete.

`workers.checkpoint.save` seals every checkpoint it writes with `shunter-manifest.json`, written last by rank 0:
`{"format": 1, "step": ..., "epoch": ..., "time": ..., "files": {"<relative path>": {"size": ..., "sha256": ...}}}`
listing every rank's files. `check` applies the completeness rule wherever a checkpoint is judged: by the progress
callback before a checkpoint may become the job's latest (`workers.storage.checkpoint_complete`) and by the loader
before it restores anything (`workers.checkpoint.verify`).

Torch-free and Ray-free: it needs a pyarrow filesystem (local or object store) and nothing else.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyarrow import fs as pafs

from service.core.locations import uri_of

MANIFEST = "shunter-manifest.json"
STATE = "shunter-state.json"  # the state file every checkpoint shunter's helpers write carries (step, epoch, ...)
FORMAT = 1


@dataclass(frozen=True)
class Verdict:
    """What `check` found: `complete`, the manifest (None when there is none), and why when it is incomplete."""

    complete: bool
    manifest: dict[str, Any] | None = None
    reason: str = ""
    manifest_sha256: str | None = None  # of the manifest's bytes as read (what the service records and proves by)


def sha256_of(path: str, filesystem: Any = None) -> str:
    """The sha256 of a file on `filesystem` (local when None), read in 1 MiB blocks."""
    filesystem = filesystem or pafs.LocalFileSystem()
    digest = hashlib.sha256()
    with filesystem.open_input_stream(path) as stream:
        while block := stream.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def listing(directory: str | Path) -> dict[str, dict[str, Any]]:
    """The manifest entries (size and sha256) of every file under a local `directory`, the manifest itself aside."""
    directory = Path(directory)
    return {
        path.relative_to(directory).as_posix(): {"size": path.stat().st_size, "sha256": sha256_of(str(path))}
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != MANIFEST
    }


def write(
    directory: str | Path, files: dict[str, dict[str, Any]], *, step: int, epoch: int, attempt: int | None = None
) -> dict[str, Any]:
    """Seal a local checkpoint folder: write its manifest atomically (a reader never sees half of one). `attempt`:
    the shunter attempt that wrote it, when known (how a checkpoint whose report was lost is listed later)."""
    directory = Path(directory)
    manifest = {"format": FORMAT, "step": step, "epoch": epoch, "time": time.time(), "files": files}
    if attempt is not None:
        manifest["attempt"] = attempt
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, directory / MANIFEST)
    return manifest


def read(root: str, filesystem: Any = None) -> dict[str, Any]:
    """The manifest of the checkpoint at `root`; ValueError when it is not one shunter can read."""
    return parse(read_bytes(root, filesystem))


def read_bytes(root: str, filesystem: Any = None) -> bytes:
    """The manifest file of the checkpoint at `root`, as stored (its sha256 is what the service records)."""
    filesystem = filesystem or pafs.LocalFileSystem()
    with filesystem.open_input_stream(posixpath.join(root, MANIFEST)) as stream:
        return bytes(stream.read())


def parse(data: bytes) -> dict[str, Any]:
    """A manifest from its bytes; ValueError when it is not one shunter can read."""
    manifest = json.loads(data)
    if not isinstance(manifest, dict) or manifest.get("format", FORMAT) != FORMAT:
        raise ValueError(f"not a format-{FORMAT} manifest")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(entry, dict) and isinstance(entry.get("size"), int) and isinstance(entry.get("sha256"), str)
        for entry in files.values()
    ):
        raise ValueError("its files are not listed with size and sha256")
    return manifest


def check(root: str, filesystem: Any = None, *, checksums: bool = False) -> Verdict:
    """Whether the checkpoint at `root` (on `filesystem`, local when None) is complete: the one rule.

    - With a manifest: complete exactly when every file it lists is there with its size (and its sha256 with
      `checksums`, which reads every byte: too slow for large remote checkpoints on every report). An unreadable
      manifest, a missing file or a wrong size means incomplete: a crash mid-save, a partial upload or copy, files
      changed afterwards.
    - Without a manifest but with shunter's state file: incomplete. shunter's helpers wrote it and the manifest,
      which comes last, never arrived.
    - With neither: complete. User code (a plain Ray Train loop, a script, a recipe's own files) wrote it, and has no
      manifest to check against; Ray Train hands a checkpoint to callbacks only after every rank's upload returned,
      so a reported checkpoint is whole as far as anything can tell. (`workers.checkpoint.load` still refuses to
      restore from it: there is no shunter state in it.)
    """
    filesystem = filesystem or pafs.LocalFileSystem()
    root = root.rstrip("/") or "/"
    if isinstance(filesystem, pafs.LocalFileSystem):
        root = os.path.abspath(root)
    where = uri_of(root, filesystem)
    manifest_info, state_info = filesystem.get_file_info([posixpath.join(root, MANIFEST), posixpath.join(root, STATE)])
    if manifest_info.type == pafs.FileType.NotFound:
        if state_info.type != pafs.FileType.NotFound:
            return Verdict(False, reason=f"{where}: {STATE} but no {MANIFEST}; the save did not finish")
        return Verdict(True)
    try:
        data = read_bytes(root, filesystem)
        manifest = parse(data)
    except (OSError, ValueError) as exc:
        return Verdict(False, reason=f"{where}: unreadable {MANIFEST} ({exc})")
    sealed = hashlib.sha256(data).hexdigest()
    files: dict[str, dict[str, Any]] = manifest["files"]
    names = list(files)
    found = filesystem.get_file_info([posixpath.join(root, name) for name in names])
    for name, info in zip(names, found, strict=True):
        if info.type != pafs.FileType.File or info.size != files[name]["size"]:
            return Verdict(False, reason=f"{where}: {name} is missing or has the wrong size", manifest_sha256=sealed)
    if checksums:
        for name, info in zip(names, found, strict=True):
            if sha256_of(info.path, filesystem) != files[name]["sha256"]:
                return Verdict(False, reason=f"{where}: {name} does not match its sha256", manifest_sha256=sealed)
    return Verdict(True, manifest=manifest, manifest_sha256=sealed)
