"""Storage locations: a local/shared path or an object-store URI, as a pyarrow filesystem.

`s3://bucket/prefix` works against AWS or any S3-compatible server (MinIO, Ceph, moto): the endpoint comes from
SHUNTER_S3_ENDPOINT_URL (or AWS_ENDPOINT_URL), credentials and region from the standard AWS_* variables. The control
plane (preemption notices) and the workers (Ray Train's storage) share this; it needs pyarrow, not torch or Ray.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyarrow import fs as pafs

ENV_S3_ENDPOINT = "SHUNTER_S3_ENDPOINT_URL"
# Where the object store is (not who may use it): the service hands these to its jobs and to its local Ray head.
# Credentials are never among them: jobs write with the cluster's own.
STORE_LOCATION_ENV = (ENV_S3_ENDPOINT, "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION")
PREEMPT_MARKER = "shunter-preempt"


def s3_filesystem() -> pafs.S3FileSystem:
    """A pyarrow S3 filesystem from SHUNTER_S3_ENDPOINT_URL and the standard AWS_* variables."""
    from pyarrow import fs

    kwargs: dict[str, Any] = {}
    endpoint = os.environ.get(ENV_S3_ENDPOINT) or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        scheme, sep, host = endpoint.partition("://")
        # pyarrow wants host[:port] and the scheme apart; a bare host means https, as for AWS itself.
        kwargs["endpoint_override"] = host.rstrip("/") if sep else endpoint.rstrip("/")
        kwargs["scheme"] = scheme if sep else "https"
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        kwargs["region"] = region
    elif endpoint:
        # Without a region pyarrow asks AWS where the bucket lives, which a private endpoint cannot answer.
        kwargs["region"] = "us-east-1"
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if key and secret:
        # Explicit keys travel with the pickled filesystem to the Train controller and workers on every node, which
        # need not have the driver's environment; without them each process falls back to its own AWS chain.
        kwargs["access_key"], kwargs["secret_key"] = key, secret
        if os.environ.get("AWS_SESSION_TOKEN"):
            kwargs["session_token"] = os.environ["AWS_SESSION_TOKEN"]
    # Ray Train creates `bucket/prefix/<run>` with create_dir; on a fresh bucket (a new MinIO, a test server) that
    # must be allowed to create the bucket, and it is a no-op where the bucket exists.
    return fs.S3FileSystem(allow_bucket_creation=True, **kwargs)


def filesystem_for(uri: str) -> tuple[str, Any]:
    """(storage_path, pyarrow filesystem or None) for `RunConfig(storage_path=..., storage_filesystem=...)`."""
    if "://" not in uri:
        os.makedirs(uri, exist_ok=True)
        return uri, None
    scheme, _, rest = uri.partition("://")
    if scheme in ("s3", "s3a"):
        # With an explicit filesystem Ray Train wants the path without its scheme: `bucket/prefix`.
        path = rest.strip("/")
        if not path:
            raise ValueError(f"checkpoint storage {uri!r} names no bucket")
        return path, s3_filesystem()
    if scheme == "file":
        os.makedirs(rest, exist_ok=True)
        return rest, None
    return uri, None  # gs://, hdfs://, ...: pyarrow resolves these from the URI and the environment


def uri_of(path: str, filesystem: Any) -> str:
    """A URI for `path` on `filesystem` that a user, the API and `filesystem_for` understand."""
    kind = getattr(filesystem, "type_name", "local") if filesystem is not None else "local"
    if kind == "local":
        return path
    if kind == "s3":
        return f"s3://{path.lstrip('/')}"
    if kind == "gcs":
        return f"gs://{path.lstrip('/')}"
    return f"{kind}://{path.lstrip('/')}"


def preemption_marker(storage_uri: str, job_id: str) -> tuple[str, pafs.FileSystem | None]:
    """(path, pyarrow filesystem or None for a local path) of the notice asking job `job_id` to yield.

    The dispatcher writes it beside the job's checkpoints under `storage_uri` (the job's checkpoint storage); the
    job's workers look for it at every report (`workers.preemption`), checkpoint at once and let the job be requeued.
    """
    root, filesystem = filesystem_for(storage_uri)
    return f"{root.rstrip('/')}/{job_id}/{PREEMPT_MARKER}", filesystem
