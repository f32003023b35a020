"""`workers.session` outside Ray Train: a local session's checkpoints, reports and loaders (real files, real torch)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workers import session
from workers.session import ENV_LOCAL_RUN


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(ENV_LOCAL_RUN, str(tmp_path / "run"))
    (tmp_path / "run").mkdir()
    return tmp_path / "run"


def _part(tmp_path: Path, name: str, files: dict[str, str]) -> Path:
    part = tmp_path / name
    part.mkdir()
    for file, text in files.items():
        (part / file).write_text(text)
    return part


def test_a_report_with_a_checkpoint_is_a_folder_the_next_run_resumes_from(run_dir: Path, tmp_path: Path) -> None:
    assert session.get_checkpoint() is None
    session.report({"step": 1, "loss": 2.0})
    session.report(
        {"step": 2, "loss": 1.5}, checkpoint_dir=_part(tmp_path, "a", {"x": "2"}), name="checkpoint-step00000002"
    )
    session.report(
        {"step": 10, "loss": 1.0}, checkpoint_dir=_part(tmp_path, "b", {"x": "10"}), name="checkpoint-step00000010"
    )
    (run_dir / f"{session.PARTIAL}checkpoint-step00000011").mkdir()  # one a crash left half written
    latest = session.get_checkpoint()
    assert latest == run_dir / "checkpoint-step00000010" and (latest / "x").read_text() == "10"
    lines = session.reported(run_dir)
    assert [line["step"] for line in lines] == [1, 2, 10]
    assert [line.get("checkpoint") for line in lines] == [None, "checkpoint-step00000002", "checkpoint-step00000010"]
    assert all(isinstance(line["reported_at"], float) for line in lines)


def test_a_checkpoint_written_again_at_its_step_replaces_the_old_one(run_dir: Path, tmp_path: Path) -> None:
    name = "checkpoint-step00000004"
    session.report({"step": 4}, checkpoint_dir=_part(tmp_path, "a", {"old": "1", "x": "a"}), name=name)
    (run_dir / f"{session.PARTIAL}{name}").mkdir()
    (run_dir / f"{session.PARTIAL}{name}" / "stale").write_text("from a run that died")
    session.report({"step": 4}, checkpoint_dir=_part(tmp_path, "b", {"x": "b"}), name=name)
    assert sorted(p.name for p in (run_dir / name).iterdir()) == ["x"]
    assert (run_dir / name / "x").read_text() == "b"


def test_a_local_checkpoint_needs_a_name(run_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="name"):
        session.report({"step": 1}, checkpoint_dir=_part(tmp_path, "a", {}))


def test_batches_arrive_on_the_device_and_the_loader_reads_through(run_dir: Path) -> None:
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(6.0)), batch_size=2)
    wrapped = session.prepare_data_loader(loader)
    assert wrapped.batch_size == 2 and len(wrapped) == 3 and wrapped.dataset is loader.dataset
    batches = list(wrapped)
    assert [b[0].device.type for b in batches] == ["cpu"] * 3 and isinstance(batches[0], list)
    assert session._moved({"a": (torch.ones(1), "label")}, torch.device("cpu"))["a"][1] == "label"


def test_without_the_variable_the_session_is_ray_trains(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(ENV_LOCAL_RUN, raising=False)
    assert session.local_dir() is None
    with pytest.raises(RuntimeError, match=ENV_LOCAL_RUN):
        session.start_local()
    with pytest.raises(RuntimeError):  # ray.train outside a Train worker refuses; it is not written locally
        session.report({"step": 1})
    assert not list(tmp_path.iterdir())


def test_an_fp16_overflow_step_is_skipped_counted_and_leaves_the_schedule_alone() -> None:
    from service.spec.strategy import StrategySpec
    from workers.strategies.common import Prepared

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    cpu, scaler = torch.device("cpu"), torch.amp.GradScaler("cpu")
    prepared = Prepared(model=model, module=model, optimizer=optimizer, strategy=StrategySpec(), device=cpu,
                        scheduler=scheduler, scaler=scaler)  # fmt: skip
    x = torch.randn(8, 4)
    before = [p.detach().clone() for p in model.parameters()]
    assert prepared.backward(model(x).sum() * float("inf"))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert (prepared.step, prepared.skipped_steps, prepared.lr) == (1, 1, 0.1)
    assert prepared.scaler.get_scale() == 2.0**15
    assert prepared.backward(model(x).sum())
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert (prepared.step, prepared.skipped_steps, prepared.lr) == (2, 1, 0.05)
