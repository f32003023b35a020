"""Checkpoint storage on a local path and on S3 (a real `moto_server` on 127.0.0.1, not a mocked client):
the filesystem Ray Train gets, the one completeness rule (`workers.manifest.check`) as the progress callback and the
loader apply it, and a real 2-worker run that checkpoints to S3 and resumes from there at the right step."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import pytest
from pyarrow import fs

from tests.s3_server import S3Server, s3_fixture, s3_server_fixture  # noqa: F401 - fixtures `s3`, `s3_server`
from workers import manifest
from workers.manifest import MANIFEST, STATE
from workers.storage import checkpoint_at, checkpoint_complete, filesystem_for, uri_of

FILES = {
    "model.pt": b"m" * 1000,
    "optimizer.pt": b"o" * 300,
    "dcp/shard-0.distcp": b"s" * 50,
    STATE: b"{}",
}


def write_sealed(directory: Path) -> Path:
    """A checkpoint folder sealed the way workers.checkpoint.save seals one (files first, manifest last)."""
    for name, data in FILES.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(data)
    files = {name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()} for name, data in FILES.items()}
    (directory / MANIFEST).write_text(json.dumps({"format": 1, "step": 4, "epoch": 0, "time": 0.0, "files": files}))
    return directory


def upload(local: Path, s3_path: str, filesystem: Any) -> None:
    fs.copy_files(str(local), s3_path, destination_filesystem=filesystem)


# --- filesystem_for / uri_of ---------------------------------------------------------------------------------------


def test_local_path_is_created_and_needs_no_filesystem(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b"
    assert filesystem_for(str(target)) == (str(target), None)
    assert target.is_dir()
    assert filesystem_for(f"file://{target}") == (str(target), None)


def test_s3_uri_gets_an_s3_filesystem_on_the_configured_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHUNTER_S3_ENDPOINT_URL", "http://127.0.0.1:9000/")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    path, filesystem = filesystem_for("s3://bucket/some/prefix/")
    assert path == "bucket/some/prefix"  # Ray Train wants the path without its scheme next to a filesystem
    assert isinstance(filesystem, fs.S3FileSystem)
    options = filesystem.__reduce__()[1][0]  # what travels to the Train controller and workers
    assert options["endpoint_override"] == "127.0.0.1:9000"
    assert options["scheme"] == "http"
    assert options["region"] == "us-east-1"
    assert (options["access_key"], options["secret_key"]) == ("key", "secret")
    assert options["allow_bucket_creation"] is True
    assert uri_of(path, filesystem) == "s3://bucket/some/prefix"
    assert uri_of("/data/ckpt", None) == "/data/ckpt"
    assert uri_of("/data/ckpt", fs.LocalFileSystem()) == "/data/ckpt"
    with pytest.raises(ValueError, match="names no bucket"):
        filesystem_for("s3://")


def test_s3_filesystem_reaches_the_server(s3: tuple[S3Server, str]) -> None:
    server, bucket = s3
    path, filesystem = filesystem_for(f"s3://{bucket}/runs")
    filesystem.create_dir(f"{path}/job-1")  # what Ray Train does first with storage_path
    with filesystem.open_output_stream(f"{path}/job-1/hello.txt") as out:
        out.write(b"hi")
    assert "runs/job-1/hello.txt" in server.keys(bucket)
    # A bucket that does not exist yet is created on first use (a fresh MinIO or test server).
    fresh = f"{bucket}-new"
    path, filesystem = filesystem_for(f"s3://{fresh}/p")
    filesystem.create_dir(f"{path}/run")
    with filesystem.open_output_stream(f"{path}/run/x") as out:
        out.write(b"x")
    assert "p/run/x" in server.keys(fresh)


# --- the completeness rule: local ------------------------------------------------------------------------------------


def damage(directory: Path, case: str) -> Path:
    """A sealed checkpoint folder, then changed as `case` says."""
    write_sealed(directory)
    if case == "missing-with-state":  # shunter's helpers wrote it; the manifest, written last, never came
        (directory / MANIFEST).unlink()
    elif case == "missing-without-state":  # user code wrote it: neither shunter's state file nor a manifest
        (directory / MANIFEST).unlink()
        (directory / STATE).unlink()
    elif case == "size-mismatch":
        (directory / "model.pt").write_bytes(b"m" * 10)
    elif case == "file-missing":
        (directory / "dcp" / "shard-0.distcp").unlink()
    elif case == "unreadable-manifest":
        (directory / MANIFEST).write_text("{not json")
    elif case == "manifest-without-sizes":
        (directory / MANIFEST).write_text(json.dumps({"format": 1, "files": {"model.pt": {}}}))
    return directory


@pytest.mark.parametrize(
    ("case", "complete", "loadable"),
    [
        ("manifest-ok", True, True),
        ("missing-with-state", False, False),
        ("missing-without-state", True, False),  # complete as Ray Train reported it; nothing for `load` to restore
        ("size-mismatch", False, False),
        ("file-missing", False, False),
        ("unreadable-manifest", False, False),
        ("manifest-without-sizes", False, False),
    ],
)
def test_one_completeness_rule_for_the_callback_and_the_loader(
    tmp_path: Path, case: str, complete: bool, loadable: bool
) -> None:
    from ray.train import Checkpoint

    from workers.checkpoint import IncompleteCheckpointError, NotShunterCheckpointError, verify

    local = damage(tmp_path / "ckpt", case)
    verdict = manifest.check(str(local), fs.LocalFileSystem())
    assert verdict.complete is complete, verdict.reason
    assert manifest.check(str(local), fs.LocalFileSystem(), checksums=True).complete is complete
    assert bool(verdict.reason) is not complete
    assert checkpoint_complete(Checkpoint(str(local))) is complete  # the progress callback's check
    if loadable:
        assert verify(local) == verdict.manifest  # the loader's check
        assert verdict.manifest is not None and set(verdict.manifest["files"]) == set(FILES)
    elif complete:
        with pytest.raises(NotShunterCheckpointError, match=f"no {STATE} and no {MANIFEST}"):
            verify(local)
    else:
        with pytest.raises(IncompleteCheckpointError) as refused:
            verify(local)
        assert type(refused.value) is IncompleteCheckpointError
        assert str(refused.value) == verdict.reason


def test_manifest_written_by_the_helpers_lists_every_file(tmp_path: Path) -> None:
    local = tmp_path / "ckpt"
    for name, data in FILES.items():
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_bytes(data)
    written = manifest.write(local, manifest.listing(local), step=4, epoch=0)
    assert written["files"] == json.loads(write_sealed(tmp_path / "by-hand").joinpath(MANIFEST).read_text())["files"]
    assert manifest.check(str(local), checksums=True).manifest == written
    assert not (local / (MANIFEST + ".tmp")).exists()


def test_same_size_corruption_needs_checksums(tmp_path: Path) -> None:
    from ray.train import Checkpoint

    local = write_sealed(tmp_path / "ckpt")
    (local / "model.pt").write_bytes(b"x" * 1000)
    assert checkpoint_complete(Checkpoint(str(local)))  # sizes only: cheap enough for every report
    assert not checkpoint_complete(Checkpoint(str(local)), checksums=True)


def test_the_loader_proves_a_checkpoint_by_the_manifest_hash_the_service_recorded(tmp_path: Path) -> None:
    """Given the manifest's sha256 its attempt reported (issue 35), the loader's check refuses a checkpoint whose files
    and manifest were rewritten together, which its own manifest alone cannot tell."""
    from workers.checkpoint import verify
    from workers.proof import StorageTampered

    local = write_sealed(tmp_path / "ckpt")
    sealed = manifest.check(str(local)).manifest_sha256
    assert sealed is not None and verify(local, uri="s3://b/j1/ckpt", recorded=sealed)["files"].keys() == FILES.keys()
    (local / "model.pt").write_bytes(b"another job's weights")
    manifest.write(local, manifest.listing(local), step=4, epoch=0)
    assert verify(local)["files"]["model.pt"]["size"] == len(b"another job's weights")  # by itself: consistent
    with pytest.raises(StorageTampered, match="s3://b/j1/ckpt: its shunter-manifest.json is not the one"):
        verify(local, uri="s3://b/j1/ckpt", recorded=sealed)


# --- checkpoint_complete: S3 ----------------------------------------------------------------------------------------


def test_s3_checkpoint_complete_missing_manifest_and_size_mismatch(s3: tuple[S3Server, str], tmp_path: Path) -> None:
    server, bucket = s3
    root, filesystem = filesystem_for(f"s3://{bucket}/runs")
    upload(write_sealed(tmp_path / "ckpt"), f"{root}/ckpt", filesystem)
    assert len(server.keys(bucket, "runs/ckpt/")) == len(FILES) + 1

    checkpoint = checkpoint_at(f"s3://{bucket}/runs/ckpt")
    assert checkpoint.path == f"{bucket}/runs/ckpt"
    assert checkpoint_complete(checkpoint)
    assert checkpoint_complete(checkpoint, checksums=True)

    client = server.client()
    client.put_object(Bucket=bucket, Key="runs/ckpt/model.pt", Body=b"m" * 999)  # a short upload
    assert not checkpoint_complete(checkpoint)
    client.put_object(Bucket=bucket, Key="runs/ckpt/model.pt", Body=FILES["model.pt"])
    client.delete_object(Bucket=bucket, Key="runs/ckpt/dcp/shard-0.distcp")  # a file that never arrived
    assert not checkpoint_complete(checkpoint)
    client.delete_object(Bucket=bucket, Key=f"runs/ckpt/{MANIFEST}")  # shunter's state file, but no manifest
    assert not checkpoint_complete(checkpoint)
    client.delete_object(Bucket=bucket, Key=f"runs/ckpt/{STATE}")  # neither: user code wrote it
    assert checkpoint_complete(checkpoint)


def test_half_written_s3_checkpoint_is_refused_by_the_loader(s3: tuple[S3Server, str], tmp_path: Path) -> None:
    """`workers.checkpoint.load` downloads a checkpoint with `as_directory()` and verifies it before touching any
    state: a half-written one (manifest lists more than arrived) raises instead of being resumed from."""
    from workers.checkpoint import IncompleteCheckpointError, verify

    server, bucket = s3
    root, filesystem = filesystem_for(f"s3://{bucket}/runs")
    upload(write_sealed(tmp_path / "ckpt"), f"{root}/ckpt", filesystem)
    server.client().put_object(Bucket=bucket, Key="runs/ckpt/optimizer.pt", Body=b"o" * 7)
    checkpoint = checkpoint_at(f"s3://{bucket}/runs/ckpt")
    assert not checkpoint_complete(checkpoint)
    with checkpoint.as_directory() as local, pytest.raises(IncompleteCheckpointError, match="optimizer.pt"):
        verify(local)


# --- a real TorchTrainer run on S3 ----------------------------------------------------------------------------------


def _fit(storage: str, name: str, config: dict[str, Any], *, keep: int | None = None) -> Any:
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig

    from tests.workers.loops import strategy_loop
    from workers.lean_trainer import trainer_class

    storage_path, filesystem = filesystem_for(storage)
    trainer = trainer_class()(
        strategy_loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(
            name=name,
            storage_path=storage_path,
            storage_filesystem=filesystem,
            checkpoint_config=CheckpointConfig(num_to_keep=keep),
        ),
    )
    return trainer.fit()


@pytest.mark.slow
def test_torch_trainer_checkpoints_to_s3_and_resumes_from_there(
    s3: tuple[S3Server, str], ray_connected: object, tmp_path: Path
) -> None:
    import torch

    server, bucket = s3
    storage = f"s3://{bucket}/shunter"
    base = {"strategy": {"kind": "ddp"}, "model": "mlp", "out": str(tmp_path), "checkpoint_every": 2}

    started = time.monotonic()
    first = _fit(storage, "job-s3", {**base, "steps": 4, "tag": "first"}, keep=1)
    first_s = time.monotonic() - started
    checkpoints = sorted({k.split("/")[2] for k in server.keys(bucket, "shunter/job-s3/") if "/checkpoint-" in k})
    assert checkpoints == ["checkpoint-step00000004"], server.keys(bucket)  # step 2's was pruned by num_to_keep=1
    keys = server.keys(bucket, "shunter/job-s3/checkpoint-step00000004/")
    assert f"shunter/job-s3/checkpoint-step00000004/{MANIFEST}" in keys
    assert any(k.endswith("rng-rank1.json") for k in keys)  # rank 1's part was uploaded too
    assert checkpoint_complete(first.checkpoint)
    uri = uri_of(first.checkpoint.path, first.checkpoint.filesystem)
    assert uri == f"s3://{bucket}/shunter/job-s3/checkpoint-step00000004"

    # The same run name on the same storage: Ray Train restores the run from S3, the loop continues at step 5.
    started = time.monotonic()
    _fit(storage, "job-s3", {**base, "steps": 6, "tag": "second"}, keep=1)
    second_s = time.monotonic() - started
    steps = [r["step"] for r in json.loads((tmp_path / "second-records.json").read_text())]
    assert steps == [5, 6]
    before, after = torch.load(tmp_path / "first-final.pt"), torch.load(tmp_path / "second-restored.pt")
    assert all(torch.equal(before[k], after[k]) for k in before)
    print(f"S3 run: 4 steps + 2 checkpoints {first_s:.1f}s; resumed run to step 6 {second_s:.1f}s")

    # A fresh run told to start from a half-written copy refuses it rather than resuming from it.
    root, filesystem = filesystem_for(storage)
    fs.copy_files(
        f"{root}/job-s3/checkpoint-step00000006",
        f"{root}/broken",
        source_filesystem=filesystem,
        destination_filesystem=filesystem,
    )
    server.client().delete_object(Bucket=bucket, Key="shunter/broken/model.pt")
    broken = checkpoint_at(f"s3://{bucket}/shunter/broken")
    assert not checkpoint_complete(broken)
    with pytest.raises(Exception) as failure:  # noqa: PT011 - Ray wraps the worker's error
        _fit(storage, "job-s3-from-broken", {**base, "steps": 8, "tag": "third", "resume_from": broken})
    assert "IncompleteCheckpointError" in repr(failure.value) or "model.pt is missing" in str(failure.value)
    assert not (tmp_path / "third-records.json").exists()


# --- end to end through `shunter serve` -----------------------------------------------------------------------------


@pytest.mark.slow
def test_serve_job_on_s3_lists_s3_checkpoints_complete_and_pruned(
    s3: tuple[S3Server, str], ray_head: Any, tmp_path: Path
) -> None:
    from service.backends.ray_local import free_port
    from tests.service.conftest import Service, service_env, stop_leftover_ray_jobs

    server, bucket = s3
    svc = Service(data_dir=tmp_path, port=free_port(), env=service_env(tmp_path, ray_head, 0))
    svc.env["SHUNTER_PORT"] = str(svc.port)
    spec = {
        "name": "mlp-s3",
        "entrypoint": {"callable": "examples.mlp:train_loop"},
        "config": {"total_steps": 30, "checkpoint_every": 10, "report_every": 10},
        "strategy": {"kind": "ddp"},
        "resources": {"num_workers": 2, "resources_per_worker": {"CPU": 1}},
        "checkpoint": {"keep": 2, "storage": f"s3://{bucket}/jobs"},
        # The session's Ray head was started before the S3 server, so the job carries the endpoint itself
        # (SHUNTER_* names are reserved; the service forwards SHUNTER_S3_ENDPOINT_URL, AWS_ENDPOINT_URL serves too).
        "runtime_env": {"env_vars": {k: v for k, v in server.env().items() if not k.startswith("SHUNTER_")}},
    }
    svc.start()
    try:
        with svc.client() as c:
            job = c.wait(c.submit(spec).id, timeout=240)
            assert job.state == "SUCCEEDED", job.last_error
            ckpts = c.checkpoints(job.id)
    finally:
        svc.stop()
        stop_leftover_ray_jobs(ray_head)
    assert [k.step for k in ckpts] == [10, 20, 30]
    assert all(k.uri.startswith(f"s3://{bucket}/jobs/{job.id}/") for k in ckpts), [k.uri for k in ckpts]
    assert all(k.complete for k in ckpts)
    assert job.latest_checkpoint == ckpts[-1].uri
    # Ray Train's num_to_keep deleted the oldest from S3; the API marks that row pruned and keeps the newest `keep`.
    held = {key.split("/")[2] for key in server.keys(bucket, f"jobs/{job.id}/checkpoint_") if key.count("/") > 2}
    assert held == {k.uri.rsplit("/", 1)[1] for k in ckpts[1:]}
    assert [k.pruned for k in ckpts] == [True, False, False]
