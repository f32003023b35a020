"""RNG state in checkpoints is JSON (nothing in shared storage is unpickled), restored exactly; an old checkpoint's
`rng-rank*.pkl` is skipped with a warning, never loaded. Real torch, real files, one process (world size 1)."""

from __future__ import annotations

import logging
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from service.spec.strategy import StrategySpec
from workers import checkpoint, manifest
from workers.strategies.common import Prepared


def _prepared() -> Prepared:
    module = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    return Prepared(
        model=module, module=module, optimizer=optimizer, strategy=StrategySpec(), device=torch.device("cpu"), step=7
    )


def _draws() -> tuple[object, ...]:
    return (random.random(), random.gauss(0, 1), np.random.randn(3).tolist(), torch.rand(3).tolist())


def test_rng_is_saved_as_json_and_restored_exactly(tmp_path: Path) -> None:
    random.gauss(0, 1)  # leave a cached gaussian in both generators: it must survive too
    np.random.randn()
    checkpoint.save(_prepared(), tmp_path)
    assert sorted(p.name for p in tmp_path.glob("rng-rank*")) == ["rng-rank0.json"]
    expected = _draws()
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    fresh = _prepared()
    fresh.step = 0
    checkpoint._load_dir(fresh, tmp_path)
    assert fresh.step == 7
    assert _draws() == expected


class _Payload:
    """Unpickling this creates a file: proof that a pickle was loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return open, (str(self.marker), "w")


def test_an_old_pickled_rng_file_is_never_unpickled(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ckpt, marker = tmp_path / "ckpt", tmp_path / "unpickled"
    checkpoint.save(_prepared(), ckpt)
    # An older release's checkpoint: rng-rank0.pkl instead of .json, sealed by a valid manifest.
    (ckpt / "rng-rank0.json").unlink()
    (ckpt / "rng-rank0.pkl").write_bytes(pickle.dumps(_Payload(marker)))
    (ckpt / manifest.MANIFEST).unlink()
    manifest.write(ckpt, manifest.listing(ckpt), step=7, epoch=0)
    fresh = _prepared()
    fresh.step = 0
    with caplog.at_level(logging.WARNING, logger="workers.checkpoint"):
        checkpoint._load_dir(fresh, ckpt)
    assert not marker.exists()
    assert fresh.step == 7  # the rest of the checkpoint still resumes
    assert any("pickle" in r.getMessage() and "not loaded" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(("env", "sealed"), [("3", 3), (None, None), ("x", None)])
def test_the_manifest_names_the_attempt_that_wrote_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: str | None, sealed: int | None
) -> None:
    """How a checkpoint whose report was lost is later listed as its writer's
    (`service.lifecycle.reports.record_restore`)."""
    if env is None:
        monkeypatch.delenv("SHUNTER_ATTEMPT", raising=False)
    else:
        monkeypatch.setenv("SHUNTER_ATTEMPT", env)
    checkpoint.save(_prepared(), tmp_path)
    written = manifest.check(str(tmp_path), checksums=True)
    assert written.complete and written.manifest is not None
    assert written.manifest.get("attempt") == sealed and written.manifest["step"] == 7
