"""Jobs carry no service secret (issue 12): an attempt token, good for its own attempt's rows only, is the one
credential a job gets; the internal API enforces its scope over real HTTP on both databases; the runtime_env of a
submission and the environment of a local Ray head hold nothing of the service's."""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import update
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from service.backends.ray_local import head_environment
from service.config.settings import Settings
from service.dispatch.submission import build
from service.spec.job import JobSpec
from service.store.models import Attempt, Checkpoint, EndReason, Job, JobState, Metric, ProgressKey, utcnow
from service.tenancy import attempt_tokens
from service.tenancy.attempt_tokens import InvalidToken, issue, verify
from tests.live_api import LiveApi, add_attempt, live_api

SPEC = {"entrypoint": {"callable": "examples.mlp:train_loop"}, "config": {"lr": 0.5}, "resources": {"num_workers": 2}}
USER_TOKEN = "user-token-for-alice"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _swap_payload(token: str, claims: dict[str, object]) -> str:
    prefix, kid, _, sig = token.split(".")
    return ".".join([prefix, kid, _b64(json.dumps(claims).encode()), sig])


def _forge(claims: object, key: str) -> str:
    """A correctly signed token around any payload (what a holder of the key could make)."""
    import hashlib
    import hmac

    payload = _b64(json.dumps(claims).encode())
    signed = f"sat1.{attempt_tokens.key_id(key)}.{payload}"
    return f"{signed}.{_b64(hmac.new(key.encode(), signed.encode(), hashlib.sha256).digest())}"


OLD, NEW, OTHER = "old-key-" + "o" * 32, "new-key-" + "n" * 32, "other-key-" + "x" * 32
GOOD = issue("jA", 1, OLD)


@pytest.mark.parametrize(
    ("token", "keys", "expected"),
    [
        (GOOD, [OLD], ("jA", 1)),
        (issue("jA", 7, NEW), [NEW, OLD], ("jA", 7)),  # signed by the current key
        (GOOD, [NEW, OLD], ("jA", 1)),  # during a rotation: the previous key still verifies
        (GOOD, [NEW], InvalidToken),  # ... and once it is dropped, no longer
        (GOOD, [OTHER], InvalidToken),
        (GOOD, [], InvalidToken),
        (_swap_payload(GOOD, {"j": "jB", "a": 1}), [OLD], InvalidToken),  # another job, same signature
        (_swap_payload(GOOD, {"j": "jA", "a": 2}), [OLD], InvalidToken),  # another attempt
        (GOOD[:-2] + ("AA" if not GOOD.endswith("AA") else "BB"), [OLD], InvalidToken),  # signature changed
        (GOOD.replace("sat1.", "sat2.", 1), [OLD], InvalidToken),
        (GOOD + ".x", [OLD], InvalidToken),
        (GOOD.rsplit(".", 1)[0], [OLD], InvalidToken),
        (GOOD.replace(attempt_tokens.key_id(OLD), attempt_tokens.key_id(NEW)), [OLD, NEW], InvalidToken),
        (GOOD[:-1] + "*", [OLD], InvalidToken),  # not base64url
        ("", [OLD], InvalidToken),
        ("Bearer " + GOOD, [OLD], InvalidToken),
        (GOOD + "A" * 600, [OLD], InvalidToken),  # over the length bound
        (_forge({"j": "jA", "a": True}, OLD), [OLD], InvalidToken),  # signed, but not an attempt number
        (_forge({"j": "jA", "a": 0}, OLD), [OLD], InvalidToken),
        (_forge({"j": "../jA", "a": 1}, OLD), [OLD], InvalidToken),
        (_forge(["jA", 1], OLD), [OLD], InvalidToken),
        (USER_TOKEN, [OLD], InvalidToken),
    ],
)
def test_issue_and_verify(token: str, keys: list[str], expected: object) -> None:
    if expected is InvalidToken:
        with pytest.raises(InvalidToken):
            verify(token, keys)
    else:
        assert verify(token, keys) == expected


def test_issue_refuses_what_no_job_is() -> None:
    for job_id, attempt in (("", 1), ("a.b", 1), ("jA", 0), ("jA", True), ("x" * 65, 1)):
        with pytest.raises(ValueError):
            issue(job_id, attempt, OLD)  # type: ignore[arg-type]


def test_configured_secret_and_its_previous_ones(db: Engine) -> None:
    settings = Settings(progress_secret=NEW, progress_previous_secrets=[OLD])
    keys = attempt_tokens.keys_for(db, settings)
    assert keys.current == NEW and keys.accepted == (NEW, OLD)
    with Session(db) as session:  # nothing stored when the key is configured
        assert session.exec(select(ProgressKey)).all() == []


def test_stored_key_is_made_once_and_shared(db: Engine) -> None:
    attempt_tokens.forget_cached_keys()
    first = attempt_tokens.keys_for(db, Settings())
    attempt_tokens.forget_cached_keys()  # another process: reads the same row
    second = attempt_tokens.keys_for(db, Settings())
    assert first == second and len(first.current) >= 32
    with Session(db) as session:
        rows = session.exec(select(ProgressKey)).all()
    assert [r.kid for r in rows] == [attempt_tokens.key_id(first.current)]
    token = issue("jA", 1, first.current)

    new_kid = attempt_tokens.rotate(db)
    rotated = attempt_tokens.keys_for(db, Settings())
    assert rotated.current == first.current  # the new key does not sign before every process accepts it
    assert new_kid in {attempt_tokens.key_id(k) for k in rotated.accepted}
    with Session(db) as session:  # ... time passes
        session.exec(update(ProgressKey).where(ProgressKey.kid == new_kid).values(active_from=utcnow()))  # type: ignore[call-overload]
        session.commit()
    attempt_tokens.forget_cached_keys()
    later = attempt_tokens.keys_for(db, Settings())
    assert attempt_tokens.key_id(later.current) == new_kid
    assert verify(token, later.accepted) == ("jA", 1)  # an attempt running across the rotation keeps reporting
    attempt_tokens.rotate(db)  # a second rotation drops the first key
    attempt_tokens.forget_cached_keys()
    with pytest.raises(InvalidToken):
        verify(token, attempt_tokens.keys_for(db, Settings()).accepted)
    attempt_tokens.forget_cached_keys()


# ---- the internal API over real HTTP --------------------------------------------------------------------------------
@pytest.fixture
def api(db: Engine, tmp_path: Path) -> Iterator[LiveApi]:
    attempt_tokens.forget_cached_keys()
    with live_api(db, tmp_path, api_tokens={USER_TOKEN: {"owner": "alice", "admin": True}}) as live:
        yield live
    attempt_tokens.forget_cached_keys()


def _job(engine: Engine, name: str, attempt: int = 1) -> str:
    job = Job(name=name, owner="alice", spec=JobSpec.model_validate(SPEC).model_dump(mode="json"),
              state=JobState.RUNNING, attempt=attempt)  # fmt: skip
    add_attempt(engine, job)
    return job.id


def _call(api: LiveApi, method: str, path: str, token: str | None, body: object = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.request(method, f"{api.url}/internal/v1/attempts/{path}", json=body, headers=headers, timeout=10)


def _counts(engine: Engine, job_id: str) -> tuple[int | None, int, int]:
    with Session(engine) as session:
        job = session.get(Job, job_id)
        assert job is not None
        metrics = session.exec(select(Metric).where(Metric.job_id == job_id)).all()
        ckpts = session.exec(select(Checkpoint).where(Checkpoint.job_id == job_id)).all()
        return job.step, len(metrics), len(ckpts)


REPORT = {"metrics": {"loss": 0.5, "step": 3}, "step": 3, "checkpoint_uri": "/ckpt/3", "keep": 2}


def test_attempt_token_writes_only_its_own_attempt(api: LiveApi) -> None:
    a, b = _job(api.engine, "a"), _job(api.engine, "b")
    token = api.token(a, 1)
    assert _call(api, "POST", f"{a}/1/report", token, REPORT).json() == {"recorded": True}
    assert _counts(api.engine, a) == (3, 1, 1)
    for path in (f"{b}/1/report", f"{a}/2/report"):  # another job; another attempt of its own job
        refused = _call(api, "POST", path, token, REPORT)
        assert refused.status_code == 403 and refused.json()["code"] == "forbidden"
    assert _call(api, "GET", f"{b}/1/spec", token).status_code == 403
    assert _call(api, "POST", f"{b}/1/end", token, {"reason": "user_error", "message": "x"}).status_code == 403
    assert _call(api, "POST", f"{b}/1/warning", token, {"code": "c", "message": "x"}).status_code == 403
    assert _counts(api.engine, b) == (None, 0, 0)
    assert _call(api, "GET", f"{a}/1/spec", token).json() == JobSpec.model_validate(SPEC).model_dump(mode="json")
    assert _call(api, "GET", f"{a}/1/reported", token).json() == {"reported": True}
    assert _call(api, "GET", f"{b}/1/reported", api.token(b, 1)).json() == {"reported": False}
    assert _call(api, "POST", f"{a}/1/warning", token, {"code": "c", "message": "m"}).json() == {"recorded": True}
    assert _call(api, "POST", f"{a}/1/warning", token, {"code": "c", "message": "m"}).json() == {"recorded": False}
    ended = _call(api, "POST", f"{a}/1/end", token, {"reason": "worker_lost", "message": "lost"})
    assert ended.json() == {"recorded": True}
    with Session(api.engine) as session:
        row = session.exec(select(Attempt).where(Attempt.job_id == a)).one()
        assert (row.end_reason, row.message) == (EndReason.WORKER_LOST, "lost")
        assert session.exec(select(Attempt).where(Attempt.job_id == b)).one().end_reason is None


def test_a_driver_started_after_its_cancel_is_refused_its_spec(api: LiveApi) -> None:
    """Ray can start a driver whose Job it already marked STOPPED (the stop landed while the runtime env was set up:
    seen in CI, the driver then trained a 4-worker job unseen for the rest of the run). The spec is refused to it."""
    a = _job(api.engine, "a")
    with Session(api.engine) as session:
        session.exec(update(Job).where(Job.id == a).values(state=JobState.CANCELLING))  # type: ignore[call-overload]
        session.commit()
    refused = _call(api, "GET", f"{a}/1/spec", api.token(a, 1))
    assert refused.status_code == 409 and "cancelled" in refused.json()["detail"]


def test_only_attempt_tokens_open_the_internal_api(api: LiveApi) -> None:
    a = _job(api.engine, "a")
    for token in (None, USER_TOKEN, "garbage", issue(a, 1, "not-this-deployments-key-" + "k" * 20)):
        refused = _call(api, "POST", f"{a}/1/report", token, REPORT)
        assert refused.status_code == 401 and refused.json()["code"] == "unauthorized", token
        assert _call(api, "GET", f"{a}/1/spec", token).status_code == 401
    assert _counts(api.engine, a) == (None, 0, 0)
    # ... and an attempt token opens nothing of the user API, while the user token does.
    attempt_token = api.token(a, 1)
    assert httpx.get(f"{api.url}/v1/jobs/{a}", headers={"Authorization": f"Bearer {attempt_token}"}).status_code == 401
    assert httpx.get(f"{api.url}/v1/jobs/{a}", headers={"Authorization": f"Bearer {USER_TOKEN}"}).status_code == 200


def test_an_old_attempts_token_is_fenced(api: LiveApi) -> None:
    a = _job(api.engine, "a", attempt=1)
    old = api.token(a, 1)
    with Session(api.engine) as session:  # the job moved on to attempt 2 (a retry)
        session.exec(update(Job).where(Job.id == a).values(attempt=2))  # type: ignore[call-overload]
        session.add(Attempt(job_id=a, number=2, submission_id=f"shunter-{a}-2"))
        session.commit()
    assert _call(api, "POST", f"{a}/1/report", old, REPORT).json() == {"recorded": False}
    assert _call(api, "POST", f"{a}/1/warning", old, {"code": "c", "message": "m"}).json() == {"recorded": False}
    assert _call(api, "GET", f"{a}/1/spec", old).status_code == 409
    assert _counts(api.engine, a) == (None, 0, 0)
    new = api.token(a, 2)
    assert _call(api, "POST", f"{a}/2/report", new, REPORT).json() == {"recorded": True}
    with Session(api.engine) as session:  # ended: the current attempt's token is fenced too
        session.exec(update(Job).where(Job.id == a).values(state=JobState.SUCCEEDED))  # type: ignore[call-overload]
        session.commit()
    assert _call(api, "POST", f"{a}/2/report", new, REPORT).json() == {"recorded": False}
    assert _counts(api.engine, a) == (3, 1, 1)


@pytest.mark.parametrize(
    "body",
    [
        b'{"metrics": {"loss": NaN}, "step": 1}',
        b'{"metrics": {"loss": Infinity}, "step": 1}',
        b'{"metrics": {"loss": 1e400}, "step": 1}',
        b'{"metrics": {"loss": "0.5"}, "step": 1}',
        b'{"metrics": {"loss": true}, "step": 1}',
        b'{"metrics": {"step": 1e12}, "step": 1}',
        b'{"metrics": {}, "step": -1}',
        b'{"metrics": {}, "step": 1, "owner": "bob"}',
        json.dumps({"metrics": {f"m{i}": 1.0 for i in range(300)}, "step": 1}).encode(),
        json.dumps({"metrics": {"x" * 200: 1.0}, "step": 1}).encode(),
    ],
)
def test_report_bodies_are_checked(api: LiveApi, body: bytes) -> None:
    a = _job(api.engine, "a")
    headers = {"Authorization": f"Bearer {api.token(a, 1)}", "Content-Type": "application/json"}
    response = httpx.post(f"{api.url}/internal/v1/attempts/{a}/1/report", content=body, headers=headers)
    assert response.status_code == 422, response.text
    assert _counts(api.engine, a) == (None, 0, 0)


def test_bodies_are_size_bounded_and_ends_are_the_drivers_own(api: LiveApi) -> None:
    a = _job(api.engine, "a")
    token = api.token(a, 1)
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    big = json.dumps({"metrics": {}, "step": 1, "checkpoint_uri": "x" * (100 * 1024)}).encode()
    assert httpx.post(f"{api.url}/internal/v1/attempts/{a}/1/report", content=big, headers=headers).status_code == 413

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"metrics": {}, "step": 1, "checkpoint_uri": "'
        for _ in range(100):
            yield b"x" * 1024
        yield b'"}'

    chunked = httpx.post(f"{api.url}/internal/v1/attempts/{a}/1/report", content=chunks(), headers=headers)
    assert chunked.status_code == 413
    # Preemption and timeouts are the dispatcher's decisions, never the driver's to claim.
    for reason in ("preempted", "timeout", "nonsense"):
        assert _call(api, "POST", f"{a}/1/end", token, {"reason": reason}).status_code == 422, reason
    # Success is: its train function returned (what a Ray Job's SUCCEEDED says too), recorded once.
    said = _call(api, "POST", f"{a}/1/end", token, {"reason": "succeeded", "message": "succeeded"})
    assert said.status_code == 200 and said.json() == {"recorded": True}
    again = _call(api, "POST", f"{a}/1/end", token, {"reason": "user_error", "message": "changed my mind"})
    assert again.status_code == 200 and again.json() == {"recorded": False}


# ---- nothing of the service's reaches a job ------------------------------------------------------------------------
SECRETS = {
    "SHUNTER_DATABASE_URL": "postgresql+psycopg://shunter:db-password-Zq81@db.internal:5432/shunter",
    "SHUNTER_API_TOKENS": json.dumps({"api-token-Hk20": {"owner": "ops", "admin": True}}),
    "SHUNTER_PROGRESS_SECRET": "progress-secret-Pw77-" + "s" * 24,
    "SHUNTER_PROGRESS_PREVIOUS_SECRETS": json.dumps(["previous-secret-Vv31-" + "p" * 24]),
    "AWS_ACCESS_KEY_ID": "AKIAEXAMPLEKEYID0042",
    "AWS_SECRET_ACCESS_KEY": "aws-secret-Rr55/abcdefghijklmnopqrstu",
    "AWS_SESSION_TOKEN": "aws-session-token-Tt66",
    "HF_TOKEN": "hf_token_Ll09",
}
SECRET_VALUES = ["db-password-Zq81", "api-token-Hk20", "progress-secret-Pw77", "previous-secret-Vv31",
                 "AKIAEXAMPLEKEYID0042", "aws-secret-Rr55", "aws-session-token-Tt66", "hf_token_Ll09"]  # fmt: skip


def test_submission_env_carries_no_service_secret(db: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_REGION", "eu-west-1")  # where the object store is: forwarded
    settings = Settings(storage_uri=str(tmp_path / "ckpt"), data_dir=tmp_path / "data", port=8123)
    assert settings.progress_secret and settings.api_tokens and settings.database_url.startswith("postgresql")
    job = Job(name="env", spec=JobSpec.model_validate(SPEC).model_dump(mode="json"), state=JobState.STARTING, attempt=2)
    add_attempt(db, job)
    with Session(db) as session:
        sub = build(session, job, JobSpec.model_validate(SPEC), settings)
    dumped = json.dumps({"entrypoint": sub.entrypoint, "runtime_env": sub.runtime_env, "metadata": sub.metadata})
    leaked = [v for v in [*SECRET_VALUES, str(db.url), db.url.database or "-"] if v in dumped]
    assert leaked == []
    env = sub.runtime_env["env_vars"]
    assert "SHUNTER_JOB_SPEC" not in env and not any("DATABASE" in name for name in env)
    assert env["SHUNTER_PROGRESS_URL"] == "http://127.0.0.1:8123"
    assert env["SHUNTER_JOB_ID"] == job.id and env["SHUNTER_ATTEMPT"] == "2"
    assert env["AWS_REGION"] == "eu-west-1"
    keys = attempt_tokens.keys_for(db, settings)
    # Not the attempt token (Ray's dashboard shows this environment): a one-use credential the driver trades for it.
    assert "SHUNTER_ATTEMPT_TOKEN" not in env and "sat1." not in dumped
    assert verify(env["SHUNTER_BOOTSTRAP"], keys.accepted, prefix=attempt_tokens.BOOTSTRAP) == (job.id, 2)
    with pytest.raises(attempt_tokens.InvalidToken):
        verify(env["SHUNTER_BOOTSTRAP"], keys.accepted)  # it is no attempt token
    # The stored-key mode puts no key in the env either.
    monkeypatch.delenv("SHUNTER_PROGRESS_SECRET")
    attempt_tokens.forget_cached_keys()
    with Session(db) as session:
        stored = build(session, job, JobSpec.model_validate(SPEC), Settings(public_url="http://api.example:8080/"))
    key = attempt_tokens.keys_for(db, Settings()).current
    assert key not in json.dumps(stored.runtime_env)
    assert stored.runtime_env["env_vars"]["SHUNTER_PROGRESS_URL"] == "http://api.example:8080"
    attempt_tokens.forget_cached_keys()


def test_a_stored_spec_that_sets_reserved_variables_cannot_steer_the_driver(db: Engine, tmp_path: Path) -> None:
    """Reserved names are refused at submission; a row stored before that rule is stripped when its job runs."""
    settings = Settings(storage_uri=str(tmp_path / "ckpt"), data_dir=tmp_path / "data", progress_secret="k" * 32)
    stored = {**SPEC, "runtime_env": {"env_vars": {"SHUNTER_RESUME_FROM": "/elsewhere/ckpt", "shunter_job_id": "jX",
                                                   "RAY_JOB_STOP_SIGNAL": "SIGKILL", "MY_FLAG": "1"}}}  # fmt: skip
    spec = JobSpec.model_construct(**JobSpec.model_validate(SPEC).__dict__)
    spec.runtime_env = stored["runtime_env"]  # as read from a row written before the rule (no validation)
    job = Job(name="old", spec=stored, state=JobState.STARTING, attempt=1)
    add_attempt(db, job)
    with Session(db) as session:
        env = build(session, job, spec, settings).runtime_env["env_vars"]
    assert env["MY_FLAG"] == "1"
    assert "SHUNTER_RESUME_FROM" not in env and "shunter_job_id" not in env and "RAY_JOB_STOP_SIGNAL" not in env
    assert env["SHUNTER_JOB_ID"] == job.id


def test_local_head_environment_is_allow_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    kept = {"HOME": "/home/u", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1",
            "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "0", "NCCL_DEBUG": "INFO", "GLOO_SOCKET_IFNAME": "lo",
            "AWS_REGION": "eu-west-1", "VIRTUAL_ENV": "/venv"}  # fmt: skip
    for name, value in kept.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SOMETHING_ELSE", "not-listed")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = head_environment("/repo")
    assert not [v for v in SECRET_VALUES if v in json.dumps(env)]
    assert not [name for name in env if name.startswith("SHUNTER_") and name != "SHUNTER_S3_ENDPOINT_URL"]
    assert "SOMETHING_ELSE" not in env
    assert {k: env[k] for k in kept} == kept
    assert env["PYTHONPATH"] == os.pathsep.join(["/repo", "/elsewhere"])
    assert env["RAY_JOB_STOP_SIGNAL"] == "SIGINT" and env["PATH"]
