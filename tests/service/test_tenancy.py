"""Two deployment modes (issue 12): with API tokens a non-admin's spec may not make the service read its own host
(local runtime_env paths and files, its own checkpoint storage, another owner's code); reserved variables are refused
in both modes; code ships through `POST /v1/code`.

Real app over real HTTP (TestClient) on both databases (Ray at a closed port: nothing here reaches Ray), real files
for the code store; one end-to-end job through `shunter serve` on the session's Ray head.
"""

from __future__ import annotations

import hashlib
import io
import json
import uuid
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.engine import Engine

from api.app import create_app
from api.client import zip_directory
from service.backends.ray_jobs import RayJobs
from service.config.settings import Settings
from service.runtime import Runtime
from service.spec.job import JobSpec
from service.tenancy import code_store
from service.tenancy.auth import Caller
from service.tenancy.modes import check_spec

TOKENS = {
    "tok-alice": {"owner": "alice"},
    "tok-bob": {"owner": "bob"},
    "tok-root": {"owner": "ops", "admin": True},
}
GOOD: dict[str, Any] = {"entrypoint": {"callable": "examples.mlp:train_loop"}, "resources": {"num_workers": 1}}
CODE_LIMIT = 4096


def _settings(db: Engine, tmp_path: Path, tokens: dict[str, Any] | None) -> Settings:
    return Settings(
        database_url=db.url.render_as_string(hide_password=False),
        ray_address="127.0.0.1:9",
        ray_dashboard_url="http://127.0.0.1:9",
        data_dir=tmp_path / "data",
        storage_uri=str(tmp_path / "storage"),
        api_tokens=tokens,
        queues={"default": {}},
        max_code_bytes=CODE_LIMIT,
    )


@pytest.fixture
def api(db: Engine, tmp_path: Path) -> Iterator[Callable[..., TestClient]]:
    """`api(token)`: a client of the token-mode app; `api(None, local=True)`: of the local-mode app (one database)."""
    runtimes: dict[bool, Runtime] = {}
    clients: list[TestClient] = []

    def make(token: str | None = None, *, local: bool = False) -> TestClient:
        if local not in runtimes:
            settings = _settings(db, tmp_path, None if local else TOKENS)
            runtimes[local] = Runtime(settings=settings, engine=db, ray=RayJobs("http://127.0.0.1:9"))
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        client = TestClient(create_app(runtime=runtimes[local]), raise_server_exceptions=False, headers=headers)
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)
    for runtime in runtimes.values():
        runtime.ray.close()


def _zip(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def _upload(client: TestClient, body: bytes, **kwargs: Any) -> Any:
    return client.post("/v1/code", content=body, headers={"Content-Type": "application/zip"}, **kwargs)


# What reads the service's host (or writes where it should not) when the service submits a non-admin's job.
REFUSED = [
    ({"runtime_env": {"working_dir": "/home/shunter"}}, "runtime_env.working_dir"),
    ({"runtime_env": {"working_dir": "."}}, "runtime_env.working_dir"),
    ({"runtime_env": {"working_dir": "file:///home/shunter/code.zip"}}, "runtime_env.working_dir"),
    ({"runtime_env": {"working_dir": "local:///home/shunter"}}, "runtime_env.working_dir"),
    ({"runtime_env": {"working_dir": "gcs://_ray_pkg_0123456789abcdef.zip"}}, "runtime_env.working_dir"),
    ({"runtime_env": {"working_dir": "https://example.com/code/"}}, "runtime_env.working_dir"),
    ({"runtime_env": {"py_modules": ["/home/shunter/.aws"]}}, "runtime_env.py_modules"),
    ({"runtime_env": {"py_modules": ["s3://bucket/lib.zip", "./lib"]}}, "runtime_env.py_modules"),
    ({"runtime_env": {"pip": "/home/shunter/requirements.txt"}}, "runtime_env.pip"),
    ({"runtime_env": {"pip": {"packages": "/home/shunter/requirements.txt"}}}, "runtime_env.pip"),
    ({"runtime_env": {"uv": "/home/shunter/requirements.txt"}}, "runtime_env.uv"),
    ({"runtime_env": {"conda": "/home/shunter/environment.yml"}}, "runtime_env.conda"),
    ({"runtime_env": {"conda": "base"}}, "runtime_env.conda"),
    ({"checkpoint": {"storage": "/srv/shunter/checkpoints"}}, "checkpoint.storage"),
]
# Remote code and inline environments: fine for anyone.
ALLOWED = [
    {"runtime_env": {"working_dir": "s3://bucket/team/code.zip"}},
    {"runtime_env": {"working_dir": "gs://bucket/code.zip", "excludes": ["data/"]}},
    {"runtime_env": {"working_dir": "https://example.com/code.zip?version=3"}},
    {"runtime_env": {"py_modules": ["s3://bucket/lib.zip", "https://example.com/pkg-1.0-py3-none-any.whl"]}},
    {"runtime_env": {"pip": ["torch", "numpy<2"], "env_vars": {"NCCL_DEBUG": "INFO", "RAY_DEDUP_LOGS": "0"}}},
    {"runtime_env": {"pip": {"packages": ["requests"], "pip_check": False}}},
    {"runtime_env": {"uv": ["requests"]}},
    {"runtime_env": {"conda": {"dependencies": ["pip", {"pip": ["requests"]}]}}},
    {"runtime_env": {"image_uri": "rayproject/ray:2.60.0", "config": {"setup_timeout_seconds": 600}}},
    {"checkpoint": {"resume_from": "none", "keep": 2}},
]
RESERVED = ["SHUNTER_RESUME_FROM", "SHUNTER_JOB_STORAGE", "shunter_progress_database_url", "SHUNTER_S3_ENDPOINT_URL",
            "RAY_ADDRESS", "RAY_JOB_STOP_SIGNAL", "RAY_JOB_STOP_WAIT_TIME_S", "RAY_TRAIN_V2_ENABLED",
            "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"]  # fmt: skip


@pytest.mark.parametrize(("patch", "field"), REFUSED, ids=[f"{f}-{i}" for i, (_, f) in enumerate(REFUSED)])
def test_token_mode_refuses_a_non_admin_what_reads_the_service_host(
    api: Callable[..., TestClient], patch: dict[str, Any], field: str
) -> None:
    alice, root, local = api("tok-alice"), api("tok-root"), api(None, local=True)
    r = alice.post("/v1/jobs", json={**GOOD, **patch})
    assert r.status_code == 422, r.text
    assert r.json()["field"] == field and r.json()["code"] == "invalid_spec", r.json()
    assert alice.get("/v1/jobs").json()["items"] == []
    # The same spec: an admin's, and anyone's in single-user local mode, are queued.
    for client in (root, local):
        accepted = client.post("/v1/jobs", json={**GOOD, **patch})
        assert accepted.status_code == 201, accepted.text


@pytest.mark.parametrize("patch", ALLOWED)
def test_remote_code_and_inline_environments_are_accepted_from_a_non_admin(
    api: Callable[..., TestClient], patch: dict[str, Any]
) -> None:
    r = api("tok-alice").post("/v1/jobs", json={**GOOD, **patch})
    assert r.status_code == 201, r.text


@pytest.mark.parametrize("name", RESERVED)
def test_reserved_variables_are_refused_in_both_modes(api: Callable[..., TestClient], name: str) -> None:
    body = {**GOOD, "runtime_env": {"env_vars": {"FOO": "bar", name: "x"}}}
    for client in (api("tok-alice"), api("tok-root"), api(None, local=True)):
        r = client.post("/v1/jobs", json=body)
        assert r.status_code == 422, r.text
        assert r.json()["field"] == f"runtime_env.env_vars.{name}", r.json()
    assert api("tok-root").get("/v1/jobs").json()["items"] == []


def test_code_upload_round_trip_and_owner_scoping(api: Callable[..., TestClient], tmp_path: Path) -> None:
    alice, bob, root = api("tok-alice"), api("tok-bob"), api("tok-root")
    archive = _zip({"code/train.py": b"def loop(config):\n    pass\n"})
    assert api().post("/v1/code", content=archive).status_code == 401  # token mode: no anonymous uploads

    r = _upload(alice, archive)
    assert r.status_code == 201, r.text
    body = r.json()
    sha = hashlib.sha256(archive).hexdigest()
    stored = (tmp_path / "storage" / "code" / "alice" / f"{sha}.zip").resolve()
    assert body == {"uri": stored.as_uri(), "sha256": sha, "size": len(archive)}
    assert stored.read_bytes() == archive
    assert _upload(alice, archive).json()["uri"] == body["uri"]  # same content, same URI

    spec = {**GOOD, "runtime_env": {"working_dir": body["uri"]}}
    assert alice.post("/v1/jobs", json=spec).status_code == 201  # her own upload
    r = bob.post("/v1/jobs", json=spec)  # bob may not run alice's code archive
    assert r.status_code == 422 and r.json()["field"] == "runtime_env.working_dir", r.text
    bob_uri = _upload(bob, archive).json()["uri"]
    assert bob_uri != body["uri"] and "/code/bob/" in bob_uri
    assert bob.post("/v1/jobs", json={**GOOD, "runtime_env": {"working_dir": bob_uri}}).status_code == 201
    assert root.post("/v1/jobs", json=spec).status_code == 201  # an admin may
    # Other spellings of a path into the service's storage are not "her own upload".
    for uri in (body["uri"].replace("/alice/", "/bob/../alice/"), body["uri"] + "?x=1", body["uri"].upper()):
        r = alice.post("/v1/jobs", json={**GOOD, "runtime_env": {"py_modules": [uri]}})
        assert r.status_code == 422 and r.json()["field"] == "runtime_env.py_modules", (uri, r.text)


@pytest.mark.parametrize(
    "members",
    [
        {"../evil.py": b"x"},
        {"code/../../evil.py": b"x"},
        {"/etc/cron.d/evil": b"x"},
        {"C:/evil.py": b"x"},
        {"code\\..\\evil.py": b"x"},
    ],
)
def test_code_upload_refuses_members_that_leave_the_folder(
    api: Callable[..., TestClient], members: dict[str, bytes], tmp_path: Path
) -> None:
    r = _upload(api("tok-alice"), _zip({"code/ok.py": b"", **members}))
    assert r.status_code == 422 and r.json()["field"] == "body", r.text
    assert not (tmp_path / "storage" / "code" / "alice").exists() or not any(
        (tmp_path / "storage" / "code" / "alice").iterdir()
    )


def test_code_upload_refuses_what_is_not_a_zip_and_what_is_too_large(api: Callable[..., TestClient]) -> None:
    alice, local = api("tok-alice"), api(None, local=True)
    for body in (b"PK\x03\x04 not really a zip", b"just text", b""):
        r = _upload(alice, body)
        assert r.status_code == 422 and r.json()["field"] == "body", r.text
    corrupt = bytearray(_zip({"code/a.py": b"print('hello world')\n" * 20}))
    corrupt[40] ^= 0xFF  # a byte of the member's data: the CRC no longer matches
    assert _upload(alice, bytes(corrupt)).status_code == 422

    big = _zip({"code/blob.bin": bytes(range(256)) * 64})  # stored uncompressed: over CODE_LIMIT
    assert len(big) > CODE_LIMIT
    r = _upload(alice, big)
    assert r.status_code == 413 and r.json()["code"] == "too_large", r.text

    def chunks() -> Iterator[bytes]:  # no Content-Length: the bound holds while reading
        for start in range(0, len(big), 1000):
            yield big[start : start + 1000]

    r = alice.post("/v1/code", content=chunks(), headers={"Content-Type": "application/zip"})
    assert r.status_code == 413, r.text
    # Local mode: the single user ("anonymous") uploads with no token.
    ok = _upload(local, _zip({"code/a.py": b""}))
    assert ok.status_code == 201 and "/code/anonymous/" in ok.json()["uri"], ok.text


def test_check_spec_with_an_object_store(tmp_path: Path) -> None:
    """s3 storage: the owner's code URIs are s3:// ones; another owner's, or anything else in the storage, refused."""
    settings = Settings(storage_uri="s3://bucket/shunter", data_dir=tmp_path, api_tokens=TOKENS)
    alice = Caller(owner="alice", admin=False)
    sha = "ab" * 32
    assert code_store.owner_prefix(settings, "alice") == "s3://bucket/shunter/code/alice/"

    def spec(uri: str) -> JobSpec:
        return JobSpec.model_validate({**GOOD, "runtime_env": {"working_dir": uri}})

    check_spec(spec(f"s3://bucket/shunter/code/alice/{sha}.zip"), alice, settings)
    check_spec(spec("s3://bucket/shunterother/code.zip"), alice, settings)
    for uri in (f"s3://bucket/shunter/code/bob/{sha}.zip", f"S3://bucket/shunter/code/bob/{sha}.zip",
                "s3://bucket/shunter/j123/checkpoint_000001/model.zip"):  # fmt: skip
        with pytest.raises(Exception) as refused:  # noqa: PT011 - InvalidSpec, checked below
            check_spec(spec(uri), alice, settings)
        assert getattr(refused.value, "field", None) == "runtime_env.working_dir", uri
    check_spec(spec(f"s3://bucket/shunter/code/bob/{sha}.zip"), Caller(owner="ops", admin=True), settings)
    # Owners that are not plain names get a digest folder: no "/" or ".." reaches the path.
    assert code_store.owner_segment("../bob") == code_store.owner_segment("../bob")
    assert "/" not in code_store.owner_segment("a/../b") and code_store.owner_segment("..").startswith("u-")


def test_zip_directory_leaves_out_the_default_excludes(tmp_path: Path) -> None:
    src = tmp_path / "proj"
    for rel in ("train.py", "pkg/__init__.py", "pkg/model.py", ".git/config", "pkg/__pycache__/model.cpython-311.pyc",
                ".venv/bin/python", "notes.pyc", ".env.example"):  # fmt: skip
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(rel)
    first, second = io.BytesIO(), io.BytesIO()
    assert zip_directory(src, first) == 4
    zip_directory(src, second)
    assert first.getvalue() == second.getvalue()  # fixed member times: same folder, same archive, same URI
    names = sorted(zipfile.ZipFile(first).namelist())
    assert names == ["proj/.env.example", "proj/pkg/__init__.py", "proj/pkg/model.py", "proj/train.py"]


TINY_MODULE = """
def train_loop(config):
    import ray.train

    for step in range(1, 3):
        ray.train.report({"step": step, "loss": 1.0 / step})
"""


@pytest.mark.slow
def test_submit_working_dir_runs_code_that_lives_only_in_the_upload(service: Any, tmp_path: Path) -> None:
    """`shunter submit --working-dir DIR` zips DIR, uploads it, and the job imports its train loop from it."""
    module = f"tiny_uploaded_{uuid.uuid4().hex[:8]}"
    code = tmp_path / "usercode"
    (code / ".git").mkdir(parents=True)
    (code / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (code / f"{module}.py").write_text(TINY_MODULE)
    spec_file = tmp_path / "spec.json"
    spec = {
        "name": "uploaded-code",
        "entrypoint": {"callable": f"{module}:train_loop"},
        "resources": {"num_workers": 1, "resources_per_worker": {"CPU": 1}},
    }
    spec_file.write_text(json.dumps(spec))

    out = service.cli("submit", str(spec_file), "--working-dir", str(code), "--json")
    job_id = json.loads(out.stdout)["id"]
    with service.client() as c:
        job = c.wait(job_id, timeout=240)
        assert job.state == "SUCCEEDED", (job.last_error, c.logs(job_id)[-3000:])
        uri = c._call("GET", f"/v1/jobs/{job_id}")["spec"]["runtime_env"]["working_dir"]
    assert uri.startswith("file://") and "/code/anonymous/" in uri and uri.endswith(".zip")
    stored = Path(uri.removeprefix("file://"))
    assert stored.is_file() and stored.is_relative_to(service.data_dir / "checkpoints" / "code")
    names = zipfile.ZipFile(stored).namelist()
    assert names == [f"usercode/{module}.py"]  # .git left out
    with service.client() as c:  # its driver checked the unpacked folder against what the upload recorded (issue 35)
        assert "working directory verified: 1 file(s) of" in c.logs(job_id)
        with zipfile.ZipFile(stored, "w") as rewritten:  # the storage root is every job's: one rewrites the archive
            rewritten.writestr(f"usercode/{module}.py", TINY_MODULE + "raise SystemExit('foreign')\n")
        again = c.wait(c.submit({**spec, "runtime_env": {"working_dir": uri}}).id, timeout=120)
    assert (again.state, again.end_reason) == ("FAILED", "storage_tampered") and uri in (again.last_error or "")


def test_a_working_dir_upload_leaves_out_what_gitignore_and_rayignore_say(tmp_path: Path) -> None:
    """Issue 38, item 7: `shunter submit --working-dir` (the CLI, a real process, against a live API) uploads what
    `ray job submit --working-dir` would: each folder's .gitignore and .rayignore patterns, gitignore's rules
    (directories, negation, anchoring), relative to their folder."""
    import subprocess
    import sys

    from service.store.db import make_engine
    from service.store.migrate import upgrade
    from tests.live_api import live_api

    src = tmp_path / "proj"
    files = {
        "train.py": "", ".gitignore": "data/\n*.ckpt\n!keep.ckpt\n/local.txt\n", ".rayignore": "wandb/\n",
        "data/big.bin": "", "best.ckpt": "", "keep.ckpt": "", "local.txt": "", "pkg/local.txt": "",
        "wandb/run.log": "", "pkg/.gitignore": "*.tmp\n", "pkg/model.py": "", "pkg/scratch.tmp": "", "notes.tmp": "",
    }  # fmt: skip
    for rel, text in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    spec = tmp_path / "job.yaml"
    spec.write_text("entrypoint: {callable: 'train:main'}\n")
    engine = make_engine(f"sqlite:///{tmp_path / 'api.db'}")
    upgrade(engine)
    repo = Path(__file__).resolve().parents[2]
    with live_api(engine, tmp_path) as api:
        out = subprocess.run(
            [sys.executable, "-m", "api.cli", "submit", str(spec), "--working-dir", str(src), "--server", api.url,
             "--json"], capture_output=True, text=True, timeout=120, cwd=repo,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        uri = json.loads(out.stdout)["spec"]["runtime_env"]["working_dir"]
    engine.dispose()
    archive = Path(uri.removeprefix("file://"))
    names = sorted(n.removeprefix("proj/") for n in zipfile.ZipFile(archive).namelist())
    assert names == [".gitignore", ".rayignore", "keep.ckpt", "notes.tmp", "pkg/.gitignore", "pkg/local.txt",
                     "pkg/model.py", "train.py"]  # fmt: skip
