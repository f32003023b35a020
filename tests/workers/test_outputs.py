"""Script mode's outputs (`workers.outputs`) on real files: checkpoint dirs sealed with shunter's manifest once
complete (a newer sibling, `mark_saved`, the end), across two nodes by part listings, top-level files mirrored when
stable, `restore` and `latest_checkpoint` for a retry; on a local path and on S3 (a real `moto_server`)."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_for
from tests.s3_server import S3Server, s3_fixture, s3_server_fixture  # noqa: F401 - fixtures `s3`, `s3_server`
from workers import manifest
from workers.manifest import MANIFEST
from workers.output_sync import OutputSync
from workers.outputs import PARTS, QUIET_SECONDS, TMP_MARK, latest_checkpoint, restore, step_of, storage_of


def write(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    path.write_bytes(data)
    return path


def hf_checkpoint(directory: Path, step: int, *, rank: int | None = None, model: bytes | None = None) -> Path:
    """A checkpoint dir the way HF Trainer writes one (a subfolder included)."""
    write(directory / "model.safetensors", model if model is not None else b"w" * (100 + step))
    write(directory / "optimizer" / "state.pt", b"o" * (50 + step))
    write(directory / "trainer_state.json", json.dumps({"global_step": step}))
    if rank is not None:
        write(directory / f"rng_state_{rank}.pth", f"rng of rank {rank} at {step}")
    return directory


def stored_files(stored: Path) -> dict[str, bytes]:
    """Every file under a stored dir, without shunter's manifest and parts."""
    return {
        path.relative_to(stored).as_posix(): path.read_bytes()
        for path in stored.rglob("*")
        if path.is_file() and path.name != MANIFEST and PARTS not in path.parts
    }


def local_files(directory: Path) -> dict[str, bytes]:
    return {
        path.relative_to(directory).as_posix(): path.read_bytes() for path in directory.rglob("*") if path.is_file()
    }


class Calls(list):
    def __call__(self, uri: str, step: int | None) -> None:
        self.append((uri, step))


@pytest.fixture()
def outputs(tmp_path: Path) -> Path:
    return tmp_path / "storage" / "job-1" / "outputs"


def test_hf_checkpoints_sealed_once_each_in_order(tmp_path: Path, outputs: Path) -> None:
    out = tmp_path / "node" / "out"
    calls = Calls()
    sync = OutputSync({"out": out}, str(outputs), attempt=2, on_checkpoint=calls)
    assert sync.scan() is True  # no root yet: nothing to do, nothing raised
    hf_checkpoint(out / "checkpoint-3", 3)
    sync.scan()
    assert not (outputs / "out" / "checkpoint-3").exists()  # no newer sibling: maybe half-written

    write(out / "checkpoint-6" / "model.safetensors", b"half")  # checkpoint-6 is being written
    sync.scan()
    stored3 = outputs / "out" / "checkpoint-3"
    verdict = manifest.check(str(stored3), checksums=True)
    assert verdict.complete and verdict.manifest is not None, verdict.reason
    assert verdict.manifest["step"] == 3 and verdict.manifest["attempt"] == 2 and verdict.manifest["epoch"] == 0
    assert set(verdict.manifest["files"]) == set(local_files(out / "checkpoint-3"))  # no parts listed
    assert stored_files(stored3) == local_files(out / "checkpoint-3")
    assert (stored3 / PARTS / "node-0.json").is_file()
    assert not (outputs / "out" / "checkpoint-6" / MANIFEST).exists()
    assert calls == [(str(stored3), 3)]

    # Sealed once: a later change of its files is not uploaded, nor reported again.
    write(out / "checkpoint-3" / "model.safetensors", b"changed afterwards")
    write(out / "checkpoint-3" / "late.txt", b"late")
    sync.scan()
    assert (stored3 / "model.safetensors").read_bytes() == b"w" * 103 and not (stored3 / "late.txt").exists()

    hf_checkpoint(out / "checkpoint-6", 6)
    sync.mark_saved(out / "checkpoint-6")
    sync.scan()
    stored6 = outputs / "out" / "checkpoint-6"
    assert manifest.check(str(stored6), checksums=True).complete
    assert stored_files(stored6) == local_files(out / "checkpoint-6")
    assert calls == [(str(stored3), 3), (str(stored6), 6)]
    sync.stop(final=True)
    sync.scan(final=True)
    assert calls == [(str(stored3), 3), (str(stored6), 6)]
    assert not [path for path in outputs.rglob("*") if TMP_MARK in path.name]


def test_half_written_dir_waits_for_a_sibling_a_mark_or_the_end(tmp_path: Path, outputs: Path) -> None:
    out = tmp_path / "out"
    calls = Calls()
    sync = OutputSync({"out": out}, str(outputs), on_checkpoint=calls)
    write(out / "checkpoint-5" / "model.safetensors", b"half")
    for _ in range(3):
        sync.scan()
        sync.scan(final=False)
    assert not (outputs / "out" / "checkpoint-5").exists()
    hf_checkpoint(out / "checkpoint-5", 5)  # now whole
    write(out / "checkpoint-10" / "model.safetensors", b"x")
    sync.scan()
    assert stored_files(outputs / "out" / "checkpoint-5") == local_files(out / "checkpoint-5")
    assert manifest.check(str(outputs / "out" / "checkpoint-5"), checksums=True).complete
    assert not (outputs / "out" / "checkpoint-10").exists()
    # A stem of its own: `best-20` is no newer sibling of `checkpoint-10`.
    write(out / "best-20" / "model.safetensors", b"b")
    sync.scan()
    assert not (outputs / "out" / "checkpoint-10").exists()
    sync.stop(final=True)  # the script exited: the last ones count as complete
    assert manifest.check(str(outputs / "out" / "checkpoint-10")).manifest is not None
    assert manifest.check(str(outputs / "out" / "best-20")).manifest is not None
    assert [step for _, step in calls] == [5, 10, 20]


def test_dirs_without_digits_compare_by_mtime_and_take_trainer_state_step(tmp_path: Path, outputs: Path) -> None:
    out = tmp_path / "out"
    calls = Calls()
    sync = OutputSync({"out": out}, str(outputs), on_checkpoint=calls)
    hf_checkpoint(out / "best", 42)
    write(out / "last" / "model.safetensors", b"l")
    old = time.time() - 100
    for path in [out / "best", *(out / "best").rglob("*")]:
        os.utime(path, (old, old))
    sync.scan()
    assert manifest.check(str(outputs / "out" / "best")).manifest["step"] == 42  # from trainer_state.json
    assert not (outputs / "out" / "last").exists()  # the newest: maybe still being written
    sync.stop(final=True)
    assert calls == [(str(outputs / "out" / "best"), 42), (str(outputs / "out" / "last"), None)]
    assert manifest.check(str(outputs / "out" / "last")).manifest["step"] is None


def test_two_nodes_seal_with_both_parts(tmp_path: Path, outputs: Path) -> None:
    out0, out1 = tmp_path / "node0" / "out", tmp_path / "node1" / "out"
    calls0, calls1 = Calls(), Calls()
    node0 = OutputSync({"out": out0}, str(outputs), node_rank=0, nodes=2, leader=True, attempt=1, on_checkpoint=calls0)
    node1 = OutputSync({"out": out1}, str(outputs), node_rank=1, nodes=2, leader=False, attempt=1, on_checkpoint=calls1)
    for rank, out in ((0, out0), (1, out1)):
        hf_checkpoint(out / "checkpoint-3", 3, rank=rank)  # the same shared files, each rank's own RNG state
        write(out / "checkpoint-6" / "model.safetensors", b"being written")
    stored = outputs / "out" / "checkpoint-3"

    node0.scan()
    assert (stored / PARTS / "node-0.json").is_file() and not (stored / MANIFEST).exists()
    node0.scan()
    assert not (stored / MANIFEST).exists()  # node 1's part is missing
    node1.scan()
    assert (stored / PARTS / "node-1.json").is_file() and not (stored / MANIFEST).exists()  # only the leader seals
    node0.scan()
    verdict = manifest.check(str(stored), checksums=True)
    assert verdict.complete and verdict.manifest is not None, verdict.reason
    assert {"rng_state_0.pth", "rng_state_1.pth", "model.safetensors"} <= set(verdict.manifest["files"])
    assert set(verdict.manifest["files"]) == set(stored_files(stored))
    assert calls0 == [(str(stored), 3)] and calls1 == []


def test_two_nodes_conflicting_contents_are_not_sealed(
    tmp_path: Path, outputs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out0, out1 = tmp_path / "node0" / "out", tmp_path / "node1" / "out"
    calls = Calls()
    node0 = OutputSync({"out": out0}, str(outputs), nodes=2, attempt=1, on_checkpoint=calls, final_wait=5)
    node1 = OutputSync({"out": out1}, str(outputs), node_rank=1, nodes=2, leader=False, attempt=1, final_wait=5)
    hf_checkpoint(out0 / "checkpoint-3", 3, model=b"node zero's weights")
    hf_checkpoint(out1 / "checkpoint-3", 3, model=b"node one's weights!")
    with caplog.at_level(logging.ERROR, logger="workers.outputs"):
        node1.stop(final=True)
        node0.stop(final=True)
    assert not (outputs / "out" / "checkpoint-3" / MANIFEST).exists() and calls == []
    assert "different contents" in caplog.text
    assert latest_checkpoint(str(outputs)) is None


def test_a_node_without_the_dir_writes_an_empty_part(tmp_path: Path, outputs: Path) -> None:
    """Only rank 0 writes checkpoints (a plain DDP script): node 1 has no dirs, yet does not hold sealing up."""
    out0, out1 = tmp_path / "node0" / "out", tmp_path / "node1" / "out"
    calls = Calls()
    node0 = OutputSync({"out": out0}, str(outputs), nodes=2, attempt=1, on_checkpoint=calls, interval=0.05)
    node1 = OutputSync({"out": out1}, str(outputs), node_rank=1, nodes=2, leader=False, attempt=1, interval=0.05)
    hf_checkpoint(out0 / "checkpoint-3", 3)
    hf_checkpoint(out0 / "checkpoint-6", 6)
    node0.scan()
    node1.scan()  # sees node 0's part of checkpoint-3, has no such dir: an empty part
    assert json.loads((outputs / "out" / "checkpoint-3" / PARTS / "node-1.json").read_text())["files"] == {}
    node0.scan()
    assert manifest.check(str(outputs / "out" / "checkpoint-3"), checksums=True).manifest is not None
    assert calls == [(str(outputs / "out" / "checkpoint-3"), 3)]

    # The end: the leader stops first and waits for node 1's final marker, then seals checkpoint-6 without it.
    leader = threading.Thread(target=node0.stop, kwargs={"final": True})
    leader.start()
    time.sleep(0.3)
    assert leader.is_alive() and not (outputs / "out" / "checkpoint-6" / MANIFEST).exists()
    node1.stop(final=True)
    leader.join(timeout=30)
    assert not leader.is_alive()
    assert manifest.check(str(outputs / "out" / "checkpoint-6"), checksums=True).manifest is not None
    assert [step for _, step in calls] == [3, 6]


def test_parts_of_another_attempt_do_not_count(tmp_path: Path, outputs: Path) -> None:
    out0 = tmp_path / "node0" / "out"
    stale = {"node": 1, "nodes": 2, "attempt": 1, "files": {}}
    write(outputs / "out" / "checkpoint-3" / PARTS / "node-1.json", json.dumps(stale))
    node0 = OutputSync({"out": out0}, str(outputs), nodes=2, attempt=2)
    hf_checkpoint(out0 / "checkpoint-3", 3)
    node0.scan(final=True)
    node0.scan(final=True)
    assert not (outputs / "out" / "checkpoint-3" / MANIFEST).exists()


def test_top_level_files_mirrored_when_stable(tmp_path: Path, outputs: Path) -> None:
    out = tmp_path / "out"
    sync = OutputSync({"out": out}, str(outputs))
    snapshot, stored = out / "snapshot.pt", outputs / "out" / "snapshot.pt"
    write(snapshot, b"epoch 0")
    sync.scan()
    assert not stored.exists()  # seen once: maybe still being written
    sync.scan()
    assert stored.read_bytes() == b"epoch 0"
    write(snapshot, b"epoch 10, longer")
    sync.scan()
    assert stored.read_bytes() == b"epoch 0"
    sync.scan()
    assert stored.read_bytes() == b"epoch 10, longer"
    write(snapshot, b"epoch 20, longer still")
    write(out / "log.txt", b"last words")
    sync.stop(final=True)  # the end: everything changed goes, stable or not
    assert stored.read_bytes() == b"epoch 20, longer still"
    assert (outputs / "out" / "log.txt").read_bytes() == b"last words"
    assert not (outputs / "out" / MANIFEST).exists()
    assert not [path for path in outputs.rglob("*") if TMP_MARK in path.name]


def test_a_file_rewritten_before_every_scan_goes_once_it_has_rested(tmp_path: Path, outputs: Path) -> None:
    """The torchrun tutorial's snapshot, rewritten every 2 s under a 2 s scan, differs on every scan: a file that has
    not been modified for QUIET_SECONDS is uploaded all the same (it was never uploaded before this rule)."""
    out = tmp_path / "out"
    sync = OutputSync({"out": out}, str(outputs))
    snapshot, stored = out / "snapshot.pt", outputs / "out" / "snapshot.pt"
    for epoch in range(3):
        write(snapshot, f"epoch {epoch}".encode())
        at = time.time() - QUIET_SECONDS - 0.2 - (3 - epoch)  # written a while ago, and later each time
        os.utime(snapshot, (at, at))
        sync.scan()
        assert stored.read_bytes() == f"epoch {epoch}".encode()
    write(snapshot, b"being written")  # modified just now and not seen before: not yet
    sync.scan()
    assert stored.read_bytes() == b"epoch 2"


def test_a_file_rewritten_just_before_every_scan_of_the_thread_is_kept_while_it_is_rewritten(
    tmp_path: Path, outputs: Path
) -> None:
    """A writer whose period is the scans' own, a little ahead of each (the torchrun tutorial's snapshot every 2 s
    under the 2 s scan: CI saw test_script_jobs' snapshot kept only when the script ended). Every scan finds the file
    changed and modified a moment ago, so neither rule above ever holds at a scan; the thread looks again once the
    file can have rested (QUIET_SECONDS on), not a whole interval later, and keeps it while it is still rewritten."""
    out = tmp_path / "out"
    snapshot, stored = out / "snapshot.pt", outputs / "out" / "snapshot.pt"
    interval = 1.0
    sync = OutputSync({"out": out}, str(outputs), interval=interval)
    stop = threading.Event()

    def writer(started: float) -> None:
        epoch, at = 0, started + interval - 0.1  # 0.1 s before each of the thread's scans
        while not stop.wait(max(0.0, at - time.monotonic())):
            epoch, at = epoch + 1, at + interval
            write(snapshot, f"epoch {epoch}".encode())

    rewriting = threading.Thread(target=writer, args=(time.monotonic(),))
    sync.start()
    rewriting.start()
    try:
        wait_for(stored.exists, timeout=8 * interval, what="the snapshot kept while it is still rewritten")
        assert rewriting.is_alive() and stored.read_bytes().startswith(b"epoch ")
    finally:
        stop.set()
        rewriting.join()
        sync.stop(final=False)


def test_storage_away_is_retried(tmp_path: Path, outputs: Path, caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "out"
    calls = Calls()
    sync = OutputSync({"out": out}, str(outputs), on_checkpoint=calls, final_wait=0.2)
    hf_checkpoint(out / "checkpoint-1", 1)
    write(out / "snapshot.pt", b"s")
    write(outputs / "out", b"a file where the folder must go")  # storage refuses every write under it
    with caplog.at_level(logging.WARNING, logger="workers.outputs"):
        assert sync.scan(final=True) is False
        sync.stop(final=True)  # gives up after final_wait; never raises
    assert "retrying" in caplog.text and calls == []
    (outputs / "out").unlink()
    assert sync.scan(final=True) is True
    assert manifest.check(str(outputs / "out" / "checkpoint-1"), checksums=True).manifest is not None
    assert (outputs / "out" / "snapshot.pt").read_bytes() == b"s" and [s for _, s in calls] == [1]


def test_callback_failure_is_logged(tmp_path: Path, outputs: Path, caplog: pytest.LogCaptureFixture) -> None:
    seen = []

    def broken(uri: str, step: int | None) -> None:
        seen.append(step)
        raise RuntimeError("callback down")

    out = tmp_path / "out"
    sync = OutputSync({"out": out}, str(outputs), on_checkpoint=broken)
    hf_checkpoint(out / "checkpoint-1", 1)
    with caplog.at_level(logging.ERROR, logger="workers.outputs"):
        sync.stop(final=True)
        sync.scan(final=True)
    assert seen == [1] and "callback down" in caplog.text
    assert manifest.check(str(outputs / "out" / "checkpoint-1")).manifest is not None


def test_background_thread(tmp_path: Path, outputs: Path) -> None:
    out = tmp_path / "out"
    calls = Calls()
    sync = OutputSync({"out": out}, str(outputs), on_checkpoint=calls, interval=0.02)
    sync.start()
    try:
        hf_checkpoint(out / "checkpoint-2", 2)
        sync.mark_saved(str(out / "checkpoint-2"))
        wait_for(lambda: len(calls) == 1, timeout=20, what="checkpoint-2 sealed by the thread")
        hf_checkpoint(out / "checkpoint-4", 4)
    finally:
        sync.stop(final=True)
    assert [step for _, step in calls] == [2, 4]


def build_outputs(out: Path, outputs: str) -> None:
    """Storage as a finished attempt leaves it: checkpoint-3 and -6 sealed, a snapshot, and leftovers that are not
    complete checkpoints (a dir without manifest, another with a part only)."""
    sync = OutputSync({"out": out}, outputs, attempt=1)
    hf_checkpoint(out / "checkpoint-3", 3)
    hf_checkpoint(out / "checkpoint-6", 6)
    write(out / "snapshot.pt", b"snap")
    sync.stop(final=True)


def test_restore_brings_back_files_and_complete_checkpoints(tmp_path: Path, outputs: Path) -> None:
    assert restore(str(outputs), {"out": tmp_path / "empty"}) is None and latest_checkpoint(str(outputs)) is None
    out = tmp_path / "node" / "out"
    build_outputs(out, str(outputs))
    write(outputs / "out" / "checkpoint-9" / "model.safetensors", b"torn")  # never sealed
    write(outputs / "out" / "checkpoint-12" / PARTS / "node-0.json", json.dumps({"attempt": 1, "files": {}}))

    again = tmp_path / "retry" / "out"
    newest = restore(str(outputs), {"out": again})
    assert newest == again / "checkpoint-6"
    for name in ("checkpoint-3", "checkpoint-6"):
        restored = local_files(again / name)
        assert restored.pop(MANIFEST) and restored == local_files(out / name)
    assert (again / "snapshot.pt").read_bytes() == b"snap"
    assert sorted(path.name for path in again.iterdir()) == ["checkpoint-3", "checkpoint-6", "snapshot.pt"]
    assert latest_checkpoint(str(outputs)) == (str(outputs / "out" / "checkpoint-6"), 6)

    # The same node again: a local file of the same size stays, one of another size is replaced.
    write(again / "snapshot.pt", b"SNAP")
    write(again / "checkpoint-3" / "model.safetensors", b"short")
    assert restore(str(outputs), {"out": again}) == again / "checkpoint-6"
    assert (again / "snapshot.pt").read_bytes() == b"SNAP"
    assert (again / "checkpoint-3" / "model.safetensors").read_bytes() == b"w" * 103

    # The retry's sync does not seal the restored checkpoints again.
    calls = Calls()
    retry = OutputSync({"out": again}, str(outputs), attempt=2, on_checkpoint=calls)
    retry.stop(final=True)
    assert calls == [] and manifest.read(str(outputs / "out" / "checkpoint-6"))["attempt"] == 1


def test_output_dir_root_mirrors_to_outputs_itself(tmp_path: Path, outputs: Path) -> None:
    """The SHUNTER_OUTPUT_DIR root ("") is `<outputs_uri>` itself; another root nested in it keeps its own place."""
    output_dir = tmp_path / "shunter-output"
    roots = {"": output_dir, "out": output_dir / "out", "runs/a": tmp_path / "elsewhere"}
    calls = Calls()
    sync = OutputSync(roots, str(outputs), on_checkpoint=calls)
    write(output_dir / "metrics.json", b"{}")
    hf_checkpoint(output_dir / "checkpoint-1", 1)
    hf_checkpoint(output_dir / "out" / "checkpoint-2", 2)
    write(tmp_path / "elsewhere" / "events.log", b"e")
    sync.stop(final=True)
    assert (outputs / "metrics.json").read_bytes() == b"{}"
    assert manifest.check(str(outputs / "checkpoint-1"), checksums=True).manifest is not None
    assert manifest.check(str(outputs / "out" / "checkpoint-2"), checksums=True).manifest is not None
    assert not (outputs / "out" / MANIFEST).exists()  # "out" is a root, not a checkpoint dir of ""
    assert (outputs / "runs" / "a" / "events.log").read_bytes() == b"e"
    assert sorted(step for _, step in calls) == [1, 2]

    fresh = {"": tmp_path / "r0", "out": tmp_path / "r1", "runs/a": tmp_path / "r2"}
    assert restore(str(outputs), fresh) == tmp_path / "r1" / "checkpoint-2"
    assert sorted(path.name for path in (tmp_path / "r0").iterdir()) == ["checkpoint-1", "metrics.json"]
    assert sorted(path.name for path in (tmp_path / "r1").iterdir()) == ["checkpoint-2"]
    assert (tmp_path / "r2" / "events.log").read_bytes() == b"e"


def test_step_of() -> None:
    assert step_of("checkpoint-30") == 30 and step_of("global_step7") == 7 and step_of("best") is None


def test_s3_round_trip(s3: tuple[S3Server, str], tmp_path: Path) -> None:
    """Two nodes seal on S3 (node 1 has files in checkpoint-3 only), then a retry restores from there."""
    server, bucket = s3
    uri = f"s3://{bucket}/job-1/outputs"
    out0, out1 = tmp_path / "node0" / "out", tmp_path / "node1" / "out"
    calls = Calls()
    node0 = OutputSync({"out": out0}, uri, nodes=2, attempt=1, on_checkpoint=calls, final_wait=20)
    node1 = OutputSync({"out": out1}, uri, node_rank=1, nodes=2, leader=False, attempt=1, final_wait=20)
    hf_checkpoint(out0 / "checkpoint-3", 3, rank=0)
    write(out1 / "checkpoint-3" / "rng_state_1.pth", b"rng of rank 1")
    write(out0 / "snapshot.pt", b"snap")
    node0.scan()
    node1.scan(final=True)
    node0.scan()
    assert calls == []  # checkpoint-3 has no newer sibling on node 0 yet
    hf_checkpoint(out0 / "checkpoint-6", 6, rank=0)
    node0.scan()
    node0.scan()
    assert calls == [(f"{uri}/out/checkpoint-3", 3)]
    node1.stop(final=True)  # no checkpoint-6 there: its final marker says so
    node0.stop(final=True)
    assert calls == [(f"{uri}/out/checkpoint-3", 3), (f"{uri}/out/checkpoint-6", 6)]

    base, filesystem = storage_of(uri)
    verdict = manifest.check(f"{base}/out/checkpoint-3", filesystem, checksums=True)
    assert verdict.complete and verdict.manifest is not None, verdict.reason
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(verdict.manifest["files"])
    assert manifest.check(f"{base}/out/checkpoint-6", filesystem, checksums=True).manifest is not None
    keys = server.keys(bucket, "job-1/outputs/")
    assert "job-1/outputs/out/snapshot.pt" in keys and not [key for key in keys if TMP_MARK in key]
    assert latest_checkpoint(uri) == (f"{uri}/out/checkpoint-6", 6)

    again = tmp_path / "retry" / "out"
    assert restore(uri, {"out": again}) == again / "checkpoint-6"
    restored: dict[str, Any] = local_files(again / "checkpoint-6")
    assert restored.pop(MANIFEST) and restored == local_files(out0 / "checkpoint-6")
    assert local_files(again / "checkpoint-3")["rng_state_1.pth"] == b"rng of rank 1"
    assert (again / "snapshot.pt").read_bytes() == b"snap"
