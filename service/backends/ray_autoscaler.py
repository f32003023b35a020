"""Asking Ray's autoscaler for room (issue 37), through the GCS alone: what `ray.autoscaler.sdk.request_resources`
does, without the `ray.init()` connection it needs (the dispatcher holds no Ray driver).

- Autoscaler v1 (the cluster launcher's monitor, KubeRay's in-tree autoscaler by default) reads the request from the
  GCS's key-value store (`AUTOSCALER_RESOURCE_REQUEST_CHANNEL`): a JSON list of bundles, replaced by each write.
- Autoscaler v2 takes it as a cluster resource constraint over the GCS's autoscaler service.

Either way a request replaces the one before, and an empty one withdraws it. Ray's autoscaler fits the bundles to
the cluster's total capacity, ignoring what is in use (`service.policy.demand` accounts for that).
"""

from __future__ import annotations

import json
from typing import Any

from service.core.errors import InfraError


def request_resources(client: Any, gcs_address: str, bundles: list[dict[str, float]]) -> str:
    """Send the request on `client` (a `ray._raylet.GcsClient` of `gcs_address`); returns which autoscaler took it
    ("v1" or "v2"). Ray's errors are `InfraError`."""
    from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.autoscaler.v2.utils import is_autoscaler_v2

    try:
        if is_autoscaler_v2(fetch_from_server=True, gcs_client=client):
            from ray.autoscaler.v2.sdk import request_cluster_resources

            request_cluster_resources(gcs_address, [{"resources": dict(b), "label_selector": {}} for b in bundles])
            return "v2"
        client.internal_kv_put(AUTOSCALER_RESOURCE_REQUEST_CHANNEL, json.dumps(bundles).encode(), True, None)
        return "v1"
    except Exception as exc:  # noqa: BLE001 - the GCS client raises its own RpcError types
        raise InfraError(f"Ray's autoscaler at {gcs_address} did not take the request: {exc}") from exc
