"""Fixtures for API tests: the real app over a real SQLite file (Ray pointed at a closed port), with or without
tokens; the real-service fixtures are shared with tests/service."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from service.config.settings import Settings
from service.runtime import Runtime
from tests.service.conftest import db, service  # noqa: F401 - re-exported fixtures

TOKENS = {
    "tok-alice": {"owner": "alice"},
    "tok-bob": {"owner": "bob"},
    "tok-root": {"owner": "ops", "admin": True},
}
GOOD = {"entrypoint": {"callable": "examples.mlp:train_loop"}, "resources": {"num_workers": 2}}


def offline_settings(tmp_path: Path, **overrides: Any) -> Settings:
    """A real SQLite file; Ray at a closed port, so any path that would need Ray shows it."""
    return Settings(
        database_url=f"sqlite:///{tmp_path / 'api.db'}",
        ray_address="127.0.0.1:9",
        ray_dashboard_url="http://127.0.0.1:9",
        data_dir=tmp_path / "data",
        # Not the default (./shunter-data, relative to the working directory): code uploads landed in the checkout.
        **({"queues": {"default": {}, "gpu": {}, "q1": {}}, "storage_uri": str(tmp_path / "storage")} | overrides),
    )


@pytest.fixture
def app_client(tmp_path: Path) -> Iterator[Callable[..., TestClient]]:
    """`app_client(token=None, tokens=None)`: a TestClient of the real app; all clients share one database."""
    runtimes: dict[str, Runtime] = {}
    clients: list[TestClient] = []

    def make(token: str | None = None, *, tokens: dict[str, Any] | None = None) -> TestClient:
        key = "tokens" if tokens else "open"
        if key not in runtimes:
            runtimes[key] = Runtime.open(offline_settings(tmp_path, api_tokens=tokens))
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        client = TestClient(create_app(runtime=runtimes[key]), raise_server_exceptions=False, headers=headers)
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)
    for runtime in runtimes.values():
        runtime.close()
