"""Where checkpoints go: a local/shared path or an object-store URI, as a pyarrow filesystem for Ray Train.

`s3://bucket/prefix` works against AWS or any S3-compatible server (MinIO, Ceph, moto): the endpoint comes from
SHUNTER_S3_ENDPOINT_URL (or AWS_ENDPOINT_URL), credentials and region from the standard AWS_* variables.
"""

from __future__ import annotations

import hashlib
import json
import logging
import posixpath
from typing import TYPE_CHECKING, Any

from service.storage import ENV_S3_ENDPOINT, filesystem_for, s3_filesystem, uri_of  # noqa: F401 - re-exported

if TYPE_CHECKING:
    from ray.train import Checkpoint

log = logging.getLogger(__name__)

MANIFEST = "shunter-manifest.json"  # the name workers.checkpoint seals a checkpoint with (kept here: no torch import)


def checkpoint_at(uri: str) -> Checkpoint:
    """A `ray.train.Checkpoint` for a path or URI, on the filesystem shunter configures for it (S3 endpoint)."""
    from ray.train import Checkpoint

    path, filesystem = (uri, None) if "://" not in uri else filesystem_for(uri)
    return Checkpoint(path, filesystem=filesystem) if filesystem is not None else Checkpoint(uri)


def checkpoint_complete(checkpoint: Checkpoint, *, checksums: bool = False) -> bool:
    """Whether `checkpoint` matches its shunter manifest: every listed file present with its size (and sha256 with
    `checksums`, which reads every byte: too slow for large remote checkpoints on every report).

    A checkpoint without a manifest counts as complete: it was not written by shunter's helpers (a script-mode or
    recipe checkpoint), and Ray Train hands a checkpoint to callbacks only after every rank's upload returned, so
    nothing partial can be reported. The manifest is what catches the rest: a checkpoint copied or uploaded in part,
    files changed afterwards, or a manifest that lists more than arrived.
    """
    from pyarrow import fs

    filesystem = checkpoint.filesystem or fs.LocalFileSystem()
    root = checkpoint.path.rstrip("/")
    manifest_path = posixpath.join(root, MANIFEST)
    info = filesystem.get_file_info(manifest_path)
    if info.type == fs.FileType.NotFound:
        return True
    try:
        with filesystem.open_input_stream(manifest_path) as stream:
            files: dict[str, dict[str, Any]] = json.loads(stream.read())["files"]
        names = list(files)
        infos = filesystem.get_file_info([posixpath.join(root, name) for name in names])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("checkpoint %s: unreadable manifest (%s)", uri_of(root, checkpoint.filesystem), exc)
        return False
    for name, found in zip(names, infos, strict=True):
        entry = files[name]
        if found.type != fs.FileType.File or found.size != entry.get("size"):
            log.warning("checkpoint %s: %s is missing or has the wrong size", uri_of(root, checkpoint.filesystem), name)
            return False
        if checksums and entry.get("sha256") and _sha256(filesystem, found.path) != entry["sha256"]:
            log.warning("checkpoint %s: %s does not match its sha256", uri_of(root, checkpoint.filesystem), name)
            return False
    return True


def _sha256(filesystem: Any, path: str) -> str:
    digest = hashlib.sha256()
    with filesystem.open_input_stream(path) as stream:
        while block := stream.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()
