"""Issue 35, finding 5: storage a job can rewrite. Every job can write the whole storage root, another owner's code
archives and checkpoints included, and nothing checked an archive when it was used, nor a checkpoint's manifest
against anything the job could not forge. Now the service records what it was handed (an archive's files at upload,
a checkpoint's manifest hash at its report) and each attempt proves its storage by that before it runs or loads any
of it (`service.tenancy.code_proof`, `workers.proof`).

Quick tier: a real API over real HTTP (`tests.live_api`) on SQLite and PostgreSQL, real zips unpacked by Ray's own
unpacking code (no Ray started), real checkpoint folders; the driver's and the train worker's checks are called
in-process as they run first thing in their processes.
"""

from __future__ import annotations

import hashlib
import importlib
import io
import json
import os
import sys
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from ray._private.runtime_env.packaging import unzip_package
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from service.backends.noop import NoopJobs
from service.dispatch.dispatcher import Dispatcher
from service.policy.retry import decide
from service.spec.job import JobSpec
from service.store.models import Attempt, CodeArchive, EndReason, Job, JobEvent, JobState
from service.tenancy import attempt_tokens, code_manifest
from tests.live_api import LiveApi, add_attempt, live_api
from tests.service.conftest import db  # noqa: F401 - the fixture
from workers import manifest
from workers.proof import StorageTampered, prove_checkpoint, recorded_manifest, verify_working_dir

ALICE, MALLORY = "alice-token", "mallory-token"
MARKER_CODE = """from pathlib import Path
Path({marker!r}).write_text({who!r})
def train_loop(config=None):
    return None
"""


@pytest.fixture
def api(db: Engine, tmp_path: Path) -> Iterator[LiveApi]:  # noqa: F811 - the imported fixture
    attempt_tokens.forget_cached_keys()
    tokens = {ALICE: {"owner": "alice"}, MALLORY: {"owner": "mallory"}}
    with live_api(db, tmp_path, api_tokens=tokens, storage_uri=str(tmp_path / "storage")) as live:
        yield live
    attempt_tokens.forget_cached_keys()


def _zip(members: dict[str, str | bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def unpack_as_ray(archive: bytes, base: Path, name: str) -> Path:
    """Unpack a zip as Ray's agent does for a remote `working_dir` (its own code: the single top-level folder
    stripped), into `<runtime_resources>/working_dir_files/<name>` as on a node."""
    pkg = base / "runtime_resources" / "working_dir_files" / f"{name}.zip"
    pkg.parent.mkdir(parents=True, exist_ok=True)
    pkg.write_bytes(archive)
    target = pkg.with_suffix("")
    unzip_package(package_path=str(pkg), target_dir=str(target), remove_top_level_directory=True, unlink_zip=True)
    return target


def upload(api: LiveApi, token: str, archive: bytes) -> dict:
    r = httpx.post(f"{api.url}/v1/code", content=archive, timeout=30,
                   headers={"Authorization": f"Bearer {token}", "Content-Type": "application/zip"})  # fmt: skip
    assert r.status_code == 201, r.text
    return r.json()


def running_job(engine: Engine, spec: dict, owner: str = "alice") -> str:
    job = Job(name="victim", owner=owner, spec=JobSpec.model_validate(spec).model_dump(mode="json"),
              state=JobState.RUNNING, attempt=1)  # fmt: skip
    add_attempt(engine, job)
    return job.id


def spec_with(uri: str, module: str) -> dict:
    return {"entrypoint": {"callable": f"{module}:train_loop"}, "resources": {"num_workers": 1},
            "runtime_env": {"working_dir": uri}, "retries": {"max_attempts": 3}}  # fmt: skip


def test_5_another_owners_rewritten_archive_never_runs_as_its_owner(
    api: LiveApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mallory's job rewrites Alice's stored archive (`code/alice/<sha256>.zip`, writable by every job). Alice's
    next attempt ends `storage_tampered`, naming the archive: the dispatcher finds the stored bytes are not their
    upload's and never hands them to Ray; and where they were rewritten after that look (or in the folder Ray unpacked
    them into), the driver and the train worker find the unpacked file changed before importing any of it. Alice's
    module, which writes a marker when it runs, never does, nor does Mallory's."""
    module = f"victim_{uuid.uuid4().hex[:8]}"
    ran_alice, ran_mallory = tmp_path / "alice-code-ran", tmp_path / "mallory-code-ran"
    genuine = _zip({f"proj/{module}.py": MARKER_CODE.format(marker=str(ran_alice), who="alice")})
    forged = _zip({f"proj/{module}.py": MARKER_CODE.format(marker=str(ran_mallory), who="mallory")})
    uploaded = upload(api, ALICE, genuine)
    uri, sha256 = uploaded["uri"], uploaded["sha256"]
    with Session(api.engine) as session:
        row = session.exec(select(CodeArchive).where(CodeArchive.owner == "alice")).one()
    # Recorded at upload from the bytes received, as Ray will unpack them (its single top-level folder stripped).
    source = MARKER_CODE.format(marker=str(ran_alice), who="alice")
    listed = {f"{module}.py": hashlib.sha256(source.encode()).hexdigest()}
    assert (row.sha256, row.tree, row.tree_sha256) == (sha256, listed, code_manifest.digest(listed))

    r = httpx.post(f"{api.url}/v1/jobs", json=spec_with(uri, module), timeout=10,
                   headers={"Authorization": f"Bearer {ALICE}"})  # fmt: skip
    assert r.status_code == 201, r.text
    queued = r.json()["id"]
    stored = Path(uri.removeprefix("file://"))
    stored.write_bytes(forged)  # what any job can do: the storage root is every job's

    # The dispatcher: the stored archive is not its upload, so the attempt ends before Ray is asked to run it.
    backend = NoopJobs(tmp_path / "noop")
    dispatcher = Dispatcher(engine=api.engine, settings=api.settings, ray=backend, owner="d1")
    try:
        for _ in range(20):
            dispatcher.tick()
            with Session(api.engine) as session:
                job = session.get(Job, queued)
                assert job is not None
                if job.state.is_terminal:
                    break
    finally:
        dispatcher._pool.shutdown(wait=True)
    assert (job.state, job.end_reason) == (JobState.FAILED, EndReason.STORAGE_TAMPERED), job.last_error
    assert job.attempt == 1 and uri in (job.last_error or "")  # not retried: a tampered archive stays tampered
    with Session(api.engine) as session:
        failed = (JobEvent.job_id == queued, JobEvent.to_state == JobState.FAILED)
        ended = session.exec(select(JobEvent).where(*failed)).one()
    assert ended.reason == "storage_tampered" and uri in (ended.message or "") and "rewrote" in ended.message
    assert backend.list_submission_ids() == []  # never handed to Ray

    # Rewritten after the dispatcher's look: Ray unpacks the forged bytes on the node. The driver checks first.
    victim = running_job(api.engine, spec_with(uri, module))
    unpacked = unpack_as_ray(forged, tmp_path / "node", "file_storage_code_alice")
    for name, value in api.job_env(victim).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SHUNTER_CODE_DIGEST", row.tree_sha256 or "")
    monkeypatch.setenv("SHUNTER_CODE_URI", uri)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(unpacked), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.syspath_prepend(str(unpacked))  # as Ray's PYTHONPATH puts it: importable, were it not refused

    from workers.driver import classify_failure, verify_code
    from workers.train_loop import UserCallable, run_loop

    reason, message = verify_code(api.attempt_api(victim)) or (None, "")
    assert reason is EndReason.STORAGE_TAMPERED
    assert f"changed: {module}.py" in message and uri in message and str(unpacked) in message
    with Session(api.engine) as session:
        attempt = session.exec(select(Attempt).where(Attempt.job_id == victim)).one()
    assert (attempt.end_reason, attempt.message) == (EndReason.STORAGE_TAMPERED, message[-4000:])

    # A train worker checks again before it imports the job's module (another node, a later unpack).
    with pytest.raises(StorageTampered, match=f"changed: {module}.py") as refused:
        run_loop({}, loop=UserCallable(f"{module}:train_loop"))
    assert classify_failure(refused.value) is EndReason.STORAGE_TAMPERED
    assert module not in sys.modules and not ran_alice.exists() and not ran_mallory.exists()

    # The same check lets the genuine unpack through, and that module does write its marker when imported: the
    # marker's absence above is the code never having run.
    good = unpack_as_ray(genuine, tmp_path / "node2", "file_storage_code_alice")
    monkeypatch.setenv("PYTHONPATH", str(good))
    monkeypatch.syspath_prepend(str(good))
    assert verify_code(api.attempt_api(victim)) is None
    importlib.import_module(module)
    sys.modules.pop(module, None)
    assert ran_alice.read_text() == "alice" and not ran_mallory.exists()


def test_5_an_archive_recorded_before_its_listing_is_listed_only_from_proven_bytes(api: LiveApi) -> None:
    """An archive stored before listings were kept has none: its next attempt lists it from the stored file, once
    that file is proven its upload (its sha256 is its name). A file rewritten before that is tampered, not listed."""
    from service.dispatch import submission
    from service.tenancy.code_proof import ArchiveTampered

    module = f"legacy_{uuid.uuid4().hex[:8]}"
    genuine = _zip({f"{module}.py": "X = 1\n"})
    uri = upload(api, ALICE, genuine)["uri"]
    with Session(api.engine) as session:  # as a release before this one left it: a row, no listing
        row = session.exec(select(CodeArchive).where(CodeArchive.owner == "alice")).one()
        row.tree, row.tree_sha256 = None, None
        session.add(row)
        session.commit()
    victim = running_job(api.engine, spec_with(uri, module))

    def build() -> dict[str, str]:
        with Session(api.engine) as session:
            job = session.get(Job, victim)
            assert job is not None
            built = submission.build(session, job, JobSpec.model_validate(job.spec), api.settings)
        return dict(built.runtime_env["env_vars"])

    stored = Path(uri.removeprefix("file://"))
    stored.write_bytes(_zip({f"{module}.py": "X = 2\n"}))  # rewritten before anything listed it
    with pytest.raises(ArchiveTampered, match="is not the one its owner uploaded"):
        build()
    stored.write_bytes(genuine)
    listed = {f"{module}.py": hashlib.sha256(b"X = 1\n").hexdigest()}
    env = build()
    assert env["SHUNTER_CODE_DIGEST"] == code_manifest.digest(listed) and env["SHUNTER_CODE_URI"] == uri
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"
    with Session(api.engine) as session:
        row = session.exec(select(CodeArchive).where(CodeArchive.owner == "alice")).one()
    assert (row.tree, row.tree_sha256) == (listed, code_manifest.digest(listed))


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ("edit", "changed: pkg/core.py"),
        ("delete", "missing: pkg/core.py"),
        ("sitecustomize", "extra: sitecustomize.py"),  # imported by every Python process with the folder on its path
        ("pycache", "extra: pkg/__pycache__/core.cpython-311.pyc"),  # loaded in place of its checked source
        ("module", "extra: pkg/helpers.py"),  # importable as pkg.helpers
        ("extension", "extra: fast.cpython-311-x86_64-linux-gnu.so"),
        ("link", "not a plain file: pkg/core.py"),
    ],
)
def test_5_a_working_directory_differs_by_any_file_and_is_named(tmp_path: Path, change: str, named: str) -> None:
    """Changed, missing and extra files, and links, in the folder Ray unpacked: each is refused and named. The listing
    made at upload matches what Ray's own unpacking writes, whether or not the zip has one top-level folder."""
    members = {"train.py": "import pkg.core\n", "pkg/__init__.py": "", "pkg/core.py": "X = 1\n", "data/a.bin": b"\0"}
    in_top = {f"top/{k}": v for k, v in members.items()}
    for archive in (_zip(members), _zip({"top/": "", **in_top}), _zip({**in_top, "__MACOSX/top/._train.py": b"x"})):
        listed = code_manifest.of_zip(io.BytesIO(archive))
        assert listed == code_manifest.of_tree(unpack_as_ray(archive, tmp_path / uuid.uuid4().hex, "code"))[0]
        assert set(listed) == {"train.py", "pkg/__init__.py", "pkg/core.py", "data/a.bin"}
    root = unpack_as_ray(_zip(members), tmp_path / "node", "code")
    expected = code_manifest.digest(listed)
    assert verify_working_dir(root, expected=expected, uri="file:///s/code/alice/x.zip") == 4
    core = root / "pkg" / "core.py"
    if change == "edit":
        core.write_text("X = 2\n")  # same size, other bytes
    elif change == "delete":
        core.unlink()
    elif change == "sitecustomize":
        (root / "sitecustomize.py").write_text("import os\n")
    elif change == "pycache":
        (root / "pkg" / "__pycache__").mkdir()
        (root / "pkg" / "__pycache__" / "core.cpython-311.pyc").write_bytes(b"\0" * 16)
    elif change == "module":
        (root / "pkg" / "helpers.py").write_text("import os\n")
    elif change == "extension":
        (root / "fast.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\x7fELF")
    else:
        (tmp_path / "elsewhere.py").write_text("X = 1\n")
        core.unlink()
        core.symlink_to(tmp_path / "elsewhere.py")  # the same bytes, through a link out of the folder
    with pytest.raises(StorageTampered) as refused:
        verify_working_dir(root, expected=expected, uri="file:///s/code/alice/x.zip", recorded=lambda: listed)
    assert named in str(refused.value) and "none of it was run" in str(refused.value)


def test_5_data_a_job_wrote_into_its_working_directory_is_not_code_and_is_accepted(tmp_path: Path) -> None:
    """Ray reuses a node's unpacked folder for the job's next attempt: files an earlier attempt wrote there (a script
    writing `./out` without `entrypoint.outputs`) are data, not code, and the attempt runs. The same extra files with
    a changed one of the archive's, or without the service's listing to tell them apart, are refused."""
    members = {"train.py": "import pkg.core\n", "pkg/__init__.py": "", "pkg/core.py": "X = 1\n"}
    listed = code_manifest.of_zip(io.BytesIO(_zip(members)))
    root = unpack_as_ray(_zip(members), tmp_path / "node", "code")
    (root / "out").mkdir()
    (root / "out" / "metrics.json").write_text("{}")
    (root / "out" / "model.safetensors").write_bytes(b"\0" * 64)
    (root / "config.yaml").write_text("lr: 1\n")
    expected, uri = code_manifest.digest(listed), "file:///s/code/alice/x.zip"
    assert verify_working_dir(root, expected=expected, uri=uri, recorded=lambda: listed) == 3
    with pytest.raises(StorageTampered):  # nothing to tell the data from the archive's files by
        verify_working_dir(root, expected=expected, uri=uri)
    (root / "pkg" / "core.py").write_text("X = 2\n")
    with pytest.raises(StorageTampered) as refused:
        verify_working_dir(root, expected=expected, uri=uri, recorded=lambda: listed)
    assert "changed: pkg/core.py" in str(refused.value) and "config.yaml" not in str(refused.value)


SEGMENT = st.text("abcdefghijklmnopqrstuvwxyz0123456789_.-", min_size=1, max_size=6).filter(
    lambda p: p not in (".", "..")
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    paths=st.lists(st.lists(SEGMENT, min_size=1, max_size=3).map("/".join), min_size=1, max_size=6),
    top=st.none() | SEGMENT,
    macosx=st.booleans(),
)
def test_5_the_listing_made_at_upload_is_what_ray_unpacks(
    tmp_path: Path, paths: list[str], top: str | None, macosx: bool
) -> None:
    """Whatever a zip holds, with or without one top-level folder (and macOS's `__MACOSX` beside it), the files listed
    at upload are exactly those Ray's own unpacking writes, byte for byte: a genuine archive always passes the check."""
    prefix = f"{top}/" if top else ""
    members: dict[str, str | bytes] = {f"{prefix}{p}": f"{p}\n".encode() for p in paths}
    if macosx:
        members["__MACOSX/._x"] = b"resource fork"
    names = list(members)
    assume(not any(a != b and b.startswith(a + "/") for a in names for b in names))  # a file is no folder too
    archive = _zip(members)
    listed = code_manifest.of_zip(io.BytesIO(archive))
    unpacked, odd = code_manifest.of_tree(unpack_as_ray(archive, tmp_path / uuid.uuid4().hex, "code"))
    assert (listed, odd) == (unpacked, [])


def _checkpoint(folder: Path, step: int, weights: bytes) -> str:
    """A checkpoint folder as shunter's helpers seal it: its files, a state file, the manifest last."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.pt").write_bytes(weights)
    (folder / manifest.STATE).write_text(json.dumps({"step": step, "epoch": 0, "strategy": "ddp"}))
    manifest.write(folder, manifest.listing(folder), step=step, epoch=0, attempt=1)
    verdict = manifest.check(str(folder), checksums=True)
    assert verdict.complete and verdict.manifest_sha256
    return verdict.manifest_sha256


@pytest.mark.parametrize("forgery", ["file", "consistent"])
def test_5_a_rewritten_checkpoint_is_never_resumed_from(
    api: LiveApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forgery: str
) -> None:
    """The attempt that writes a checkpoint reports its manifest's sha256, which the service keeps. Another job then
    rewrites the checkpoint: one file (the manifest's own sha256 then disagrees), or files and manifest together, as a
    job can, so the checkpoint checks out against its own manifest. Either way the resume refuses it, from what the
    service recorded: `storage_tampered`, naming the checkpoint, and nothing of it is loaded."""
    spec = {"entrypoint": {"callable": "examples.mlp:train_loop"}, "resources": {"num_workers": 1}}
    victim = running_job(api.engine, spec)
    folder = tmp_path / "storage" / victim / "checkpoint-step00000010"
    sealed = _checkpoint(folder, 10, b"alice's weights " * 64)
    uri = str(folder)
    assert api.attempt_api(victim).report({"loss": 0.5}, step=10, checkpoint_uri=uri, manifest_sha256=sealed)
    for name, value in api.job_env(victim).items():
        monkeypatch.setenv(name, value)
    # What `workers.checkpoint.load` does before it loads a byte: ask the service, prove the copy it is to load.
    recorded = recorded_manifest(uri)
    assert recorded == sealed
    proven = prove_checkpoint(str(folder), uri=uri, recorded=recorded)
    assert proven is not None and proven["step"] == 10  # untouched: proven, and loaded

    if forgery == "file":
        (folder / "model.pt").write_bytes(b"mallory's weight" * 64)  # same size
    else:
        (folder / "model.pt").write_bytes(b"mallory's weights, resealed")
        manifest.write(folder, manifest.listing(folder), step=10, epoch=0, attempt=1)
        assert manifest.check(str(folder), checksums=True).complete  # it checks out against its own manifest
    with pytest.raises(StorageTampered) as refused:
        prove_checkpoint(str(folder), uri=uri, recorded=recorded_manifest(uri))
    text = str(refused.value)
    assert uri in text and "nothing of it was loaded" in text
    assert ("model.pt does not match its sha256" in text) if forgery == "file" else (f"recorded {sealed}" in text)

    # How the attempt ends: the train worker's StorageTampered names the end, which the driver may record and which is
    # never retried (a tampered checkpoint stays tampered; the user chooses where to resume from).
    from workers.driver import classify_failure

    assert classify_failure(refused.value) is EndReason.STORAGE_TAMPERED
    assert api.attempt_api(victim).end("storage_tampered", f"StorageTampered: {text}")
    no = decide(reason=EndReason.STORAGE_TAMPERED, attempt=1, max_attempts=5, backoff_seconds=1, max_backoff_seconds=1)
    assert not no.retry and "storage_tampered is not retryable" in no.why


def test_5_a_reported_manifest_hash_is_kept_and_only_a_sha256_is_taken(api: LiveApi) -> None:
    """A report's `manifest_sha256` is kept with its checkpoint and handed back to the job's attempts only (another
    job's attempt token is refused); what is not a sha256 hex digest is a 422 naming the field, and stores nothing."""
    victim = running_job(api.engine, {"entrypoint": {"callable": "examples.mlp:train_loop"}})
    other = running_job(api.engine, {"entrypoint": {"callable": "examples.mlp:train_loop"}}, owner="mallory")
    token = {"Authorization": f"Bearer {api.token(victim, 1)}"}
    url = f"{api.url}/internal/v1/attempts/{victim}/1"
    sealed = hashlib.sha256(b"a manifest").hexdigest()
    body = {"metrics": {}, "step": 1, "checkpoint_uri": "/s/ckpt-1", "manifest_sha256": sealed}
    assert httpx.post(f"{url}/report", json=body, headers=token, timeout=10).json() == {"recorded": True}
    got = httpx.get(f"{url}/checkpoint", params={"uri": "/s/ckpt-1"}, headers=token, timeout=10)
    assert got.json() == {"uri": "/s/ckpt-1", "known": True, "manifest_sha256": sealed}, got.text
    foreign = {"Authorization": f"Bearer {api.token(other, 1)}"}
    assert httpx.get(f"{url}/checkpoint", params={"uri": "/s/ckpt-1"}, headers=foreign, timeout=10).status_code == 403
    bad = {**body, "checkpoint_uri": "/s/ckpt-2", "manifest_sha256": "../../etc"}
    r = httpx.post(f"{url}/report", json=bad, headers=token, timeout=10)
    assert r.status_code == 422 and "manifest_sha256" in r.text, r.text
    none = httpx.get(f"{url}/checkpoint", params={"uri": "/s/ckpt-2"}, headers=token, timeout=10).json()
    assert none == {"uri": "/s/ckpt-2", "known": False, "manifest_sha256": None}
