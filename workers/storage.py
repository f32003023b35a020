"""Where checkpoints go: a local/shared path or an object-store URI, as a pyarrow filesystem for Ray Train."""

from __future__ import annotations

import os
from typing import Any


def filesystem_for(uri: str) -> tuple[str, Any]:
    """(storage_path, pyarrow filesystem or None) for `RunConfig`. s3:// honours SHUNTER_S3_ENDPOINT_URL."""
    if "://" not in uri:
        os.makedirs(uri, exist_ok=True)
        return uri, None
    scheme, _, rest = uri.partition("://")
    if scheme == "s3":
        from pyarrow import fs

        endpoint = os.environ.get("SHUNTER_S3_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL")
        kwargs: dict[str, Any] = {}
        if endpoint:
            kwargs["endpoint_override"] = endpoint
            kwargs["scheme"] = "https" if endpoint.startswith("https") else "http"
        if os.environ.get("AWS_REGION"):
            kwargs["region"] = os.environ["AWS_REGION"]
        return rest, fs.S3FileSystem(**kwargs)
    if scheme == "file":
        return rest, None
    return uri, None
