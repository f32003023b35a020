"""Where checkpoints go: a local/shared path or an object-store URI, as a pyarrow filesystem for Ray Train.

`s3://bucket/prefix` works against AWS or any S3-compatible server (MinIO, Ceph, moto): the endpoint comes from
SHUNTER_S3_ENDPOINT_URL (or AWS_ENDPOINT_URL), credentials and region from the standard AWS_* variables.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from service.core.locations import ENV_S3_ENDPOINT, filesystem_for, s3_filesystem, uri_of  # noqa: F401 - re-exported
from workers import manifest

if TYPE_CHECKING:
    from ray.train import Checkpoint

log = logging.getLogger(__name__)


def checkpoint_at(uri: str) -> Checkpoint:
    """A `ray.train.Checkpoint` for a path or URI, on the filesystem shunter configures for it (S3 endpoint)."""
    from ray.train import Checkpoint

    path, filesystem = (uri, None) if "://" not in uri else filesystem_for(uri)
    return Checkpoint(path, filesystem=filesystem) if filesystem is not None else Checkpoint(uri)


def checkpoint_complete(checkpoint: Checkpoint, *, checksums: bool = False) -> bool:
    """Whether a reported checkpoint is complete, by the one rule of `workers.manifest.check`: a checkpoint of
    shunter's helpers only with a manifest its files match (sizes; sha256 too with `checksums`, which reads every
    byte: too slow for large remote checkpoints on every report), one user code wrote as Ray Train reported it."""
    verdict = manifest.check(checkpoint.path, checkpoint.filesystem, checksums=checksums)
    if not verdict.complete:
        log.warning("checkpoint incomplete: %s", verdict.reason)
    return verdict.complete
