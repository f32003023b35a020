"""The attempt's trainer is Ray Train's own, less the two helper actors an attempt never uses, and with its drain
watcher in the controller's process (workers.lean_trainer).

Proven here on Ray's real default callback list, so that a Ray upgrade which renames or moves them fails this test
instead of quietly bringing the actors back; the end-to-end proof that a real job's Ray Job starts neither actor is in
tests/api/test_live_service.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray.train.torch")

from ray.train import RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402

from workers.lean_trainer import lean, trainer_class, unused_callback_types  # noqa: E402


def loop() -> None:
    pass


def names(callbacks: list[object]) -> list[str]:
    return [type(cb).__name__ for cb in callbacks]


def build(cls: type, tmp_path: Path, **kwargs: object) -> object:
    return cls(loop, scaling_config=ScalingConfig(num_workers=2),
               run_config=RunConfig(storage_path=str(tmp_path), name="lean"), **kwargs)  # fmt: skip


def test_the_attempts_trainer_drops_exactly_the_dataset_manager_and_placement_group_cleaner(tmp_path: Path) -> None:
    assert [t.__name__ for t in unused_callback_types()] == ["DatasetsCallback", "PlacementGroupCleanerCallback"]
    ray_own = names(build(TorchTrainer, tmp_path)._create_default_callbacks())
    ours = names(build(trainer_class(), tmp_path)._create_default_callbacks())
    assert "DatasetsCallback" in ray_own and "PlacementGroupCleanerCallback" in ray_own
    # ... and Ray's drain watcher runs in the controller's process (its actor switched off with Ray's setting).
    assert ours == [n for n in ray_own if n not in ("DatasetsCallback", "PlacementGroupCleanerCallback")] + [
        "InControllerPreemptionCallback"
    ]
    assert {"BackendSetupCallback", "AcceleratorSetupCallback"} <= set(ours)


def test_a_trainer_given_datasets_keeps_its_dataset_manager(tmp_path: Path) -> None:
    # A dataset factory (Ray calls it only at fit()), so that no Ray Dataset, nor a Ray instance, is made here.
    with_data = build(trainer_class(), tmp_path, datasets={"train": lambda: None})
    kept = names(with_data._create_default_callbacks())
    assert "DatasetsCallback" in kept and "PlacementGroupCleanerCallback" not in kept
    ray_own = names(build(TorchTrainer, tmp_path)._create_default_callbacks())
    leaned = names(lean(build(TorchTrainer, tmp_path)._create_default_callbacks(), has_datasets=True))
    assert leaned == [n for n in ray_own if n != "PlacementGroupCleanerCallback"]


def test_the_drain_watcher_runs_in_the_controller_unless_the_user_switched_it_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray's controller adds its own `PreemptionCallback` (a watcher actor) unless RAY_TRAIN_ENABLE_PREEMPTION_WATCHER
    says no, and passes that setting on from the driver (`get_env_vars_to_propagate`): building the attempt's callbacks
    sets it off for Ray's and adds the in-controller one; a user's own "off" leaves no watcher at all. The watcher's
    polling and stopping in the controller's process are proven by tests/service/test_drain.py (a real drain) and
    tests/api/test_live_service.py (no PreemptionWatcher process)."""
    from ray.train.v2._internal.constants import ENABLE_PREEMPTION_WATCHER_ENV_VAR, get_env_vars_to_propagate

    import workers.drain_watcher as drain_watcher

    monkeypatch.delenv(ENABLE_PREEMPTION_WATCHER_ENV_VAR, raising=False)
    monkeypatch.setattr(drain_watcher, "_switched_off_by_us", False)
    for _ in range(2):  # a second run in the same process keeps it (the setting is then shunter's own "off")
        callbacks = names(build(trainer_class(), tmp_path)._create_default_callbacks())
        assert callbacks[-1] == "InControllerPreemptionCallback"
        assert get_env_vars_to_propagate()[ENABLE_PREEMPTION_WATCHER_ENV_VAR] == "0"
    monkeypatch.setattr(drain_watcher, "_switched_off_by_us", False)
    monkeypatch.setenv(ENABLE_PREEMPTION_WATCHER_ENV_VAR, "false")  # the user's
    assert "InControllerPreemptionCallback" not in names(build(trainer_class(), tmp_path)._create_default_callbacks())


def test_the_in_controller_watcher_stops_its_thread_when_asked() -> None:
    """What `InControllerPreemptionCallback._stop_watcher` stands on: Ray's watcher polls in a thread that waits on
    `_stop_event` between polls, so setting it ends the thread at once (a Ray that renamed it fails here)."""
    from ray.train.v2._internal.execution.preemption import PreemptionWatcher

    from workers.drain_watcher import InControllerPreemptionCallback

    callback = InControllerPreemptionCallback()
    callback._watcher = watcher = PreemptionWatcher(node_to_ranks={}, poll_interval_s=600)
    assert watcher._monitor_thread.is_alive()
    callback._stop_watcher()
    watcher._monitor_thread.join(timeout=30)
    assert not watcher._monitor_thread.is_alive() and callback._watcher is None


def test_the_controllers_process_group_config_needs_no_torch(tmp_path: Path) -> None:
    """What Ray Train's controller unpickles of the attempt's trainer to set up the workers' process group
    (workers.torch_config) imports no torch; Ray's own TorchConfig does. A Ray that renamed what it calls on the workers
    fails here (`torch_config` would then fall back to Ray's)."""
    import subprocess
    import sys

    from ray import cloudpickle  # what Ray pickles a trainer's parts with

    from workers.torch_config import RAY_TORCH_NAMES, LeanTorchConfig, torch_config

    config = build(trainer_class(), tmp_path).backend_config
    assert isinstance(config, LeanTorchConfig) and config.backend == "gloo"  # Ray Train's choice without GPUs
    assert type(torch_config("nccl")) is LeanTorchConfig, RAY_TORCH_NAMES
    probe = (
        "import pickle, sys\n"
        "config = pickle.loads(sys.stdin.buffer.read())\n"
        "backend = config.backend_cls()\n"
        "assert config.to_dict() == {'backend': 'gloo', 'init_method': 'env', 'timeout_s': 1800}, config.to_dict()\n"
        "assert config.framework.name == 'TORCH' and callable(backend.on_start) and config.train_func_context\n"
        "print('torch' in sys.modules)\n"
    )
    cwd = Path(__file__).resolve().parents[2]

    def imports_torch(blob: bytes) -> bool:
        done = subprocess.run([sys.executable, "-c", probe], input=blob, capture_output=True, cwd=cwd, timeout=120)
        assert done.returncode == 0, done.stderr.decode()[-2000:]
        return done.stdout.decode().strip() == "True"

    assert not imports_torch(cloudpickle.dumps(config))
    assert imports_torch(cloudpickle.dumps(build(TorchTrainer, tmp_path).backend_config))  # Ray's own does


def _rank(rank: int, port_box: Any, out: Any) -> None:
    """A rank of a 2-rank gloo group set up as LeanTorchBackend does (rank 0 listens first), in a process of its own."""
    import torch
    import torch.distributed as dist

    from workers import torch_config

    if rank == 0:
        addr, port = torch_config._listen(timeout_s=60)
        port_box.put((addr, port))
    else:
        addr, port = port_box.get(timeout=60)
    torch_config._join(backend="gloo", world_rank=rank, world_size=2, addr=addr, port=port, timeout_s=60)
    value = torch.tensor([rank + 1.0])
    dist.all_reduce(value)
    out.put((rank, float(value)))
    dist.destroy_process_group()
    torch_config._forget_store()


def test_the_rendezvous_port_is_held_from_the_moment_it_is_chosen() -> None:
    """Ray's own set-up probed for a free port, let it go, and had torch bind it later; an outgoing connection took it
    in between once (EADDRINUSE, a slow-tier attempt failed). Rank 0's store now binds port 0 and keeps what the kernel
    gave it: nothing else can bind that port, and the group forms over it."""
    import errno
    import multiprocessing
    import socket

    from workers import torch_config

    addr, port = torch_config._listen(timeout_s=30)
    try:
        probe = socket.socket()
        with pytest.raises(OSError) as taken:
            probe.bind((addr, port))
        probe.close()
        assert taken.value.errno == errno.EADDRINUSE
    finally:
        torch_config._forget_store()
    ctx = multiprocessing.get_context("spawn")
    port_box, out = ctx.Queue(), ctx.Queue()
    ranks = [ctx.Process(target=_rank, args=(r, port_box, out)) for r in (0, 1)]
    for p in ranks:
        p.start()
    results = sorted(out.get(timeout=120) for _ in ranks)
    for p in ranks:
        p.join(timeout=60)
    assert results == [(0, 3.0), (1, 3.0)] and all(p.exitcode == 0 for p in ranks)
