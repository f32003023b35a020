"""A real S3-compatible server for tests: `moto_server` on 127.0.0.1, in its own process.

A separate process, not moto's in-thread server: Ray's controller and workers upload checkpoints to it while the
pytest process sits in `trainer.fit()`, and a `shunter serve` subprocess may use it too. Import the fixtures into a
test module (`from tests.s3_server import s3_fixture, s3_server_fixture  # noqa: F401`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.backends.ray_local import free_port
from tests.conftest import wait_for

# moto accepts any credentials; fixed ones keep signatures deterministic and never touch a real account.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "shunter-test", "AWS_SECRET_ACCESS_KEY": "shunter-test-secret"}
REGION = "us-east-1"


@dataclass(frozen=True)
class S3Server:
    endpoint_url: str

    def env(self) -> dict[str, str]:
        """The environment shunter (and boto3) read to reach this server."""
        return {
            "SHUNTER_S3_ENDPOINT_URL": self.endpoint_url,
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
            **CREDENTIALS,
        }

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=REGION,
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        )

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every object key under `prefix` in `bucket`, without the empty `dir/` markers pyarrow creates."""
        paginator = self.client().get_paginator("list_objects_v2")
        pages = paginator.paginate(Bucket=bucket, Prefix=prefix)
        return [obj["Key"] for page in pages for obj in page.get("Contents", []) if not obj["Key"].endswith("/")]


@pytest.fixture(scope="session", name="s3_server")
def s3_server_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One `moto_server` per test session (starting it costs about a second)."""
    port = free_port()
    log = (tmp_path_factory.mktemp("moto") / "moto.log").open("wb")
    moto = Path(sys.executable).parent / "moto_server"
    proc = subprocess.Popen(
        [str(moto), "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    server = S3Server(endpoint_url=f"http://127.0.0.1:{port}")

    def answers() -> bool:
        try:
            return httpx.get(f"{server.endpoint_url}/moto-api/", timeout=1).status_code < 500
        except httpx.HTTPError:
            return proc.poll() is not None  # died: stop waiting, the assert below says so

    wait_for(answers, timeout=30, what="moto_server to answer")
    assert proc.poll() is None, f"moto_server exited with {proc.returncode}; see {log.name}"
    yield server
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    log.close()


@pytest.fixture(name="s3")
def s3_fixture(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> tuple[S3Server, str]:
    """(server, a fresh empty bucket), with this process's environment pointing at the server."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    bucket = f"shunter-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=bucket)
    return s3_server, bucket
