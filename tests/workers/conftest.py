"""Worker-test fixtures: DeepSpeed's JIT ops are built once per test session (CI may also run
`python -m workers.warmup` in its setup step), never inside a timed training test."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def deepspeed_ops() -> dict[str, float]:
    """Build (or load from ~/.cache/torch_extensions) the ops DeepSpeed compiles on first use on CPU."""
    from workers.warmup import warm

    return warm(["shm_comm"])
