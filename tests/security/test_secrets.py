"""Issue 38, item 1: secrets kept out of specs, and an attempt credential Ray's records do not give away.

Quick tier: a real API over real HTTP (`tests.live_api`) on SQLite and PostgreSQL, the dispatcher's real submission
builder, real encryption. A real job reading its secret on real Ray, and the value missing from Ray's job record and
the kept log, is tests/api/test_live_service.py's.
"""

from __future__ import annotations

import json
import secrets as random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from service.backends.noop import NoopJobs
from service.config.settings import Settings
from service.core.errors import InvalidSpec
from service.core.masking import Masker
from service.dispatch.submission import BOOTSTRAP_ENV, build
from service.spec.job import JobSpec
from service.spec.secret_names import MAX_VALUE_CHARS
from service.store.models import Attempt, Job, JobState, Secret
from service.tenancy import attempt_tokens, secret_store
from tests.live_api import LiveApi, add_attempt, live_api
from tests.service.conftest import db  # noqa: F401 - the fixture

ALICE, BOB, ROOT = "alice-token", "bob-token", "root-token"
TOKENS = {ALICE: {"owner": "alice", "team": "vision"}, BOB: {"owner": "bob"}, ROOT: {"owner": "ops", "admin": True}}
SPEC = {"entrypoint": {"callable": "examples.mlp:train_loop"}, "resources": {"num_workers": 1}}
VALUE = "hf_" + "q" * 12 + "-alice-only"


class LoggingJobs(NoopJobs):
    """The noop backend, with a log text of the test's choosing for every Ray Job (what a job printed)."""

    text = ""

    def logs(self, submission_id: str) -> str | None:
        return self.text if (self.dir / submission_id).exists() else None


@pytest.fixture
def api(db: Engine, tmp_path: Path) -> Iterator[LiveApi]:  # noqa: F811 - the imported fixture
    attempt_tokens.forget_cached_keys()
    ray = LoggingJobs(tmp_path / "noop")
    with live_api(db, tmp_path, ray=ray, api_tokens=TOKENS) as live:
        live.ray = ray  # type: ignore[attr-defined]
        yield live
    attempt_tokens.forget_cached_keys()


def call(api: LiveApi, method: str, path: str, token: str = ALICE, **kw: object) -> httpx.Response:
    return httpx.request(method, f"{api.url}{path}", headers={"Authorization": f"Bearer {token}"}, timeout=10, **kw)


def running_job(engine: Engine, owner: str, spec: dict, team: str | None = None) -> Job:
    """A job of `owner` on its first attempt, as the dispatcher leaves one it admitted (spec stored as given)."""
    job = Job(name="j", owner=owner, team=team, spec=spec, state=JobState.RUNNING, attempt=1)
    add_attempt(engine, job)
    return job


def test_secrets_are_kept_by_name_and_never_answered_back(api: LiveApi) -> None:
    put = call(api, "PUT", "/v1/secrets/HF_TOKEN", json={"value": VALUE})
    assert put.status_code == 200 and VALUE not in put.text, put.text
    assert put.json()["scope"] == "owner" and put.json()["owner"] == "alice"
    # A team's and the cluster's: an admin's to keep.
    for query in ({"scope": "team", "team": "vision"}, {"scope": "cluster"}):
        refused = call(api, "PUT", "/v1/secrets/SHARED", params=query, json={"value": "not-alices"})
        assert (refused.status_code, refused.json()["field"]) == (403, "scope"), refused.text
    assert call(api, "PUT", "/v1/secrets/SHARED", ROOT, params={"scope": "cluster"}, json={"value": "c" * 8}).is_success
    assert call(api, "PUT", "/v1/secrets/TEAMS", ROOT, params={"scope": "team", "team": "vision"},
                json={"value": "t" * 8}).is_success  # fmt: skip
    assert call(api, "PUT", "/v1/secrets/OTHER", BOB, params={"owner": "alice"}, json={"value": "x" * 8}).status_code \
        == 403  # fmt: skip
    # Names are environment variables, none of shunter's or Ray's; values are bounded.
    for name, status in (("hf_token", 422), ("9LIVES", 422), ("SHUNTER_DATABASE_URL", 403), ("RAY_ADDRESS", 403)):
        bad = call(api, "PUT", f"/v1/secrets/{name}", json={"value": "v" * 8})
        assert (bad.status_code, bad.json().get("field")) == (status, "name"), (name, bad.text)
    huge = call(api, "PUT", "/v1/secrets/HUGE", json={"value": "v" * (MAX_VALUE_CHARS + 1)})
    assert (huge.status_code, huge.json()["field"]) == (422, "value"), huge.text
    # Listed by name: alice sees hers, her team's and the cluster's; bob only the cluster's; never a value.
    names = lambda token: sorted((s["scope"], s["name"]) for s in call(api, "GET", "/v1/secrets", token).json())  # noqa: E731
    assert names(ALICE) == [("cluster", "SHARED"), ("owner", "HF_TOKEN"), ("team", "TEAMS")]
    assert names(BOB) == [("cluster", "SHARED")]
    assert VALUE not in call(api, "GET", "/v1/secrets", ROOT).text
    # Kept encrypted: the row holds no value.
    with Session(api.engine) as session:
        rows = session.exec(select(Secret)).all()
    assert rows and all(VALUE not in r.ciphertext and "c" * 8 not in r.ciphertext for r in rows)
    assert call(api, "DELETE", "/v1/secrets/TEAMS", ROOT, params={"scope": "team", "team": "vision"}).status_code == 204
    assert call(api, "DELETE", "/v1/secrets/TEAMS", ROOT, params={"scope": "team", "team": "vision"}).status_code == 404


def test_a_spec_names_only_secrets_its_owner_may_use_and_never_holds_a_value(api: LiveApi) -> None:
    assert call(api, "PUT", "/v1/secrets/HF_TOKEN", json={"value": VALUE}).is_success
    assert call(api, "PUT", "/v1/secrets/SHARED", ROOT, params={"scope": "cluster"}, json={"value": "c" * 8}).is_success
    job = call(api, "POST", "/v1/jobs", json={**SPEC, "secrets": ["HF_TOKEN", "SHARED"]})
    assert job.status_code == 201, job.text
    # Bob cannot name alice's: answered as if it did not exist (it does not, for him). The cluster's he may.
    for path in ("/v1/jobs", "/v1/jobs/validate"):
        refused = call(api, "POST", path, BOB, json={**SPEC, "secrets": ["SHARED", "HF_TOKEN"]})
        assert (refused.status_code, refused.json()["field"]) == (422, "secrets[1]"), refused.text
        assert "no secret HF_TOKEN for 'bob'" in refused.json()["detail"]
    assert call(api, "POST", "/v1/jobs", BOB, json={**SPEC, "secrets": ["SHARED"]}).status_code == 201
    # A spec's own checks: a name twice, or also set in env_vars (which the Ray dashboard shows).
    twice = call(api, "POST", "/v1/jobs", json={**SPEC, "secrets": ["HF_TOKEN", "HF_TOKEN"]})
    assert (twice.status_code, twice.json()["field"], twice.json()["detail"]) == (
        422, "secrets", "secrets: HF_TOKEN is named twice"), twice.text  # fmt: skip
    both = call(api, "POST", "/v1/jobs", json={**SPEC, "secrets": ["HF_TOKEN"],
                                               "runtime_env": {"env_vars": {"HF_TOKEN": "x"}}})  # fmt: skip
    assert (both.status_code, both.json()["field"]) == (422, "secrets"), both.text
    assert "HF_TOKEN is also set in runtime_env.env_vars" in both.json()["detail"]
    # No answer about the job holds the value: the job, the list with specs, its events, the web page.
    job_id = job.json()["id"]
    answers = [call(api, "GET", f"/v1/jobs/{job_id}"),
               call(api, "GET", "/v1/jobs", params={"include": "spec", "limit": 10}),
               call(api, "GET", f"/v1/jobs/{job_id}/events"), call(api, "GET", "/ui"),
               call(api, "GET", f"/ui/jobs/{job_id}")]  # fmt: skip
    assert answers[0].json()["spec"]["secrets"] == ["HF_TOKEN", "SHARED"]
    assert [r.status_code for r in answers if r.status_code != 200] == []
    assert [r.request.url.path for r in answers if VALUE in r.text or "c" * 8 in r.text] == []


def test_a_rank_gets_its_own_jobs_values_and_no_one_elses(api: LiveApi) -> None:
    assert call(api, "PUT", "/v1/secrets/HF_TOKEN", json={"value": VALUE}).is_success
    assert call(api, "PUT", "/v1/secrets/HF_TOKEN", BOB, json={"value": "bobs-own-value"}).is_success
    assert call(api, "PUT", "/v1/secrets/SHARED", ROOT, params={"scope": "cluster"}, json={"value": "c" * 8}).is_success
    mine = running_job(api.engine, "alice", {**SPEC, "secrets": ["HF_TOKEN", "SHARED"]}, team="vision")
    assert api.attempt_api(mine.id).secrets() == {"HF_TOKEN": VALUE, "SHARED": "c" * 8}
    # Bob's job naming the same name gets bob's value; with his token, alice's job's path is closed to him.
    his = running_job(api.engine, "bob", {**SPEC, "secrets": ["HF_TOKEN"]})
    assert api.attempt_api(his.id).secrets() == {"HF_TOKEN": "bobs-own-value"}
    stolen = httpx.get(f"{api.url}/internal/v1/attempts/{mine.id}/1/secrets",
                       headers={"Authorization": f"Bearer {api.token(his.id, 1)}"}, timeout=10)  # fmt: skip
    assert stolen.status_code == 403 and VALUE not in stolen.text
    # A stored spec naming a secret its owner lacks (set straight in the database) gets nothing: 422, naming it.
    forged = running_job(api.engine, "bob", {**SPEC, "secrets": ["TEAMS_ONLY"]})
    refused = httpx.get(f"{api.url}/internal/v1/attempts/{forged.id}/1/secrets",
                        headers={"Authorization": f"Bearer {api.token(forged.id, 1)}"}, timeout=10)  # fmt: skip
    assert refused.status_code == 422 and "TEAMS_ONLY" in refused.text
    # Once the job has moved on from the attempt, its token reads nothing.
    with Session(api.engine) as session:
        row = session.get(Job, mine.id)
        assert row is not None
        row.attempt = 2
        session.add(row)
        session.commit()
    late = httpx.get(f"{api.url}/internal/v1/attempts/{mine.id}/1/secrets",
                     headers={"Authorization": f"Bearer {api.token(mine.id, 1)}"}, timeout=10)  # fmt: skip
    assert late.status_code == 409 and VALUE not in late.text


def test_a_bootstrap_credential_buys_the_attempt_token_once(api: LiveApi, tmp_path: Path) -> None:
    assert call(api, "PUT", "/v1/secrets/HF_TOKEN", json={"value": VALUE}).is_success
    spec = JobSpec.model_validate({**SPEC, "secrets": ["HF_TOKEN"]})
    job = running_job(api.engine, "alice", spec.model_dump(mode="json"))
    settings = Settings(storage_uri=str(tmp_path / "ckpt"), data_dir=tmp_path / "data")
    with Session(api.engine) as session:
        sub = build(session, job, spec, settings)
    shown = json.dumps(sub.runtime_env)  # what Ray's job record (and its dashboard) shows
    assert VALUE not in shown and "SHUNTER_ATTEMPT_TOKEN" not in shown and "sat1." not in shown
    bootstrap = sub.runtime_env["env_vars"][BOOTSTRAP_ENV]
    path = f"{api.url}/internal/v1/attempts/{job.id}/1"

    def trade(nonce: str, token: str = bootstrap) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"}
        return httpx.post(f"{path}/bootstrap", json={"nonce": nonce}, headers=headers, timeout=10)

    # A bootstrap is not an attempt token: it reports nothing and reads no secret.
    for what in ("secrets", "spec"):
        assert httpx.get(f"{path}/{what}", headers={"Authorization": f"Bearer {bootstrap}"}, timeout=10).status_code \
            == 401  # fmt: skip
    driver = random.token_urlsafe(32)
    first = trade(driver)
    assert first.status_code == 200 and first.headers["cache-control"] == "no-store", first.text
    token = first.json()["token"]
    accepted = attempt_tokens.keys_for(api.engine, api.settings).accepted
    assert attempt_tokens.verify(token, accepted) == (job.id, 1)
    assert attempt_tokens.owner_of(token, accepted) == "alice"  # the API's gate counts the job's calls as hers
    assert httpx.get(f"{path}/secrets", headers={"Authorization": f"Bearer {token}"}, timeout=10).json() == {
        "secrets": {"HF_TOKEN": VALUE}}  # fmt: skip
    # The same driver again (its answer lost to a restarting API): the same token. A copy from Ray's record: refused.
    assert trade(driver).json() == {"token": token}
    copied = trade(random.token_urlsafe(32))
    assert copied.status_code == 403 and "used already" in copied.json()["detail"] and "sat1." not in copied.text
    # On another attempt's path, or forged: refused.
    other = running_job(api.engine, "alice", spec.model_dump(mode="json"))
    elsewhere = httpx.post(f"{api.url}/internal/v1/attempts/{other.id}/1/bootstrap", json={"nonce": "n" * 32},
                           headers={"Authorization": f"Bearer {bootstrap}"}, timeout=10)  # fmt: skip
    assert elsewhere.status_code == 403 and "another job" in elsewhere.text
    assert trade(random.token_urlsafe(32), token=bootstrap[:-4] + "AAAA").status_code == 401
    with Session(api.engine) as session:
        row = session.exec(select(Attempt).where(Attempt.job_id == job.id)).one()
        assert row.bootstrap_nonce and driver not in row.bootstrap_nonce  # its hash, not the nonce
    # Once the attempt has ended, not even its own driver's nonce buys anything.
    with Session(api.engine) as session:
        row = session.get(Job, job.id)
        assert row is not None
        row.state = JobState.SUCCEEDED
        session.add(row)
        session.commit()
    assert trade(driver).status_code == 409


def test_values_at_rest_are_read_under_a_rotated_key_and_not_without_it(db: Engine, tmp_path: Path) -> None:  # noqa: F811
    old = Settings(data_dir=tmp_path, secrets_key="old-key-" + "o" * 24)
    with Session(db) as session:
        secret_store.put(session, old, scope=secret_store.Scope.owner, holder="alice", name="K", value=VALUE, by="a")
        session.commit()
    job = Job(name="j", owner="alice", spec={**SPEC, "secrets": ["K"]}, state=JobState.RUNNING, attempt=1)
    rotated = Settings(data_dir=tmp_path, secrets_key="new-key-" + "n" * 24, secrets_previous_keys=[old.secrets_key])
    with Session(db) as session:
        assert secret_store.values_for(session, rotated, job) == {"K": VALUE}
        with pytest.raises(InvalidSpec, match="cannot be read with this service's keys"):
            secret_store.values_for(session, Settings(data_dir=tmp_path, secrets_key="n" * 32), job)
    # Unset, a key is made once and kept in the database: every process sharing it reads the same values.
    stored = Settings(data_dir=tmp_path)
    with Session(db) as session:
        secret_store.put(session, stored, scope=secret_store.Scope.owner, holder="alice", name="K", value="v2-value",
                         by="a")  # fmt: skip
        session.commit()
    secret_store._stored.clear()  # another process: reads the kept key from the table
    with Session(db) as session:
        assert secret_store.values_for(session, stored, job) == {"K": "v2-value"}


def test_a_running_jobs_log_is_read_with_its_secret_values_starred_out(api: LiveApi) -> None:
    assert call(api, "PUT", "/v1/secrets/HF_TOKEN", json={"value": VALUE}).is_success
    job = call(api, "POST", "/v1/jobs", json={**SPEC, "secrets": ["HF_TOKEN"]}).json()
    ray = api_ray(api)
    ray.text = f"step 1\ntoken is {VALUE}!\n" + "x" * 50 + VALUE + "\nend\n"
    with Session(api.engine) as session:
        row = session.get(Job, job["id"])
        assert row is not None
        row.state, row.attempt = JobState.RUNNING, 1
        session.add(row)
        session.commit()
    add_attempt_row(api.engine, job["id"])
    ray.submit(submission_id=f"shunter-{job['id']}-1", entrypoint="x", runtime_env={}, metadata={})
    whole = call(api, "GET", f"/v1/jobs/{job['id']}/logs")
    assert whole.status_code == 200 and VALUE not in whole.text, whole.text
    assert whole.content == Masker([VALUE]).mask(ray.text.encode()) and len(whole.content) == len(ray.text)
    # Every byte where it was: a range that cuts a value in two shows none of it.
    cut = call(api, "GET", f"/v1/jobs/{job['id']}/logs", params={"offset": 20, "limit_bytes": 9})
    assert cut.content == whole.content[20:29] and "*" in cut.text


def api_ray(api: LiveApi) -> LoggingJobs:
    return api.ray  # type: ignore[attr-defined, no-any-return]


def add_attempt_row(engine: Engine, job_id: str) -> None:
    with Session(engine) as session:
        session.add(Attempt(job_id=job_id, number=1, submission_id=f"shunter-{job_id}-1", submitted=True))
        session.commit()


# ---- masking, property-tested ------------------------------------------------------------------------------------
VALUES = st.lists(st.text(st.sampled_from("abcXYZ-_01"), min_size=4, max_size=12), min_size=1, max_size=3)


@settings(max_examples=200, deadline=None)
@given(values=VALUES, filler=st.lists(st.text(st.sampled_from("abc \n*"), max_size=20), max_size=8), data=st.data())
def test_a_masked_range_or_stream_is_the_same_bytes_as_the_masked_whole(values: list[str], filler: list[str],
                                                                         data: st.DataObject) -> None:  # fmt: skip
    parts = [p for pair in zip(filler, values * 8, strict=False) for p in pair]
    text = "".join(parts).encode()
    masker = Masker(values)
    whole = masker.mask(text)
    assert len(whole) == len(text) and not any(v.encode() in whole for v in values)
    pos = data.draw(st.integers(0, len(text)))
    n = data.draw(st.integers(0, len(text) - pos + 3))
    assert masker.read(lambda p, k: text[p : p + k], pos, n) == whole[pos : pos + n]
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert b"".join(masker.stream(iter(chunks))) == whole


def test_the_cli_keeps_a_secret_from_standard_input_and_lists_names_only(api: LiveApi) -> None:
    import subprocess
    import sys

    def cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "api.cli", "secret", *args, "--server", api.url, "--token", ALICE]
        return subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=60, check=False)

    kept = cli("set", "HF_TOKEN", stdin=VALUE + "\n")  # the value never on the command line
    assert kept.returncode == 0 and "kept secret HF_TOKEN for alice" in kept.stdout, kept.stderr
    assert api.attempt_api(running_job(api.engine, "alice", {**SPEC, "secrets": ["HF_TOKEN"]}).id).secrets() == {
        "HF_TOKEN": VALUE}  # fmt: skip
    listed = cli("list", "--json")
    assert [s["name"] for s in json.loads(listed.stdout)] == ["HF_TOKEN"] and VALUE not in listed.stdout
    refused = cli("set", "SHUNTER_X", stdin="v" * 8)  # 403: a reserved name
    assert refused.returncode != 0 and "name" in refused.stderr + refused.stdout
    assert cli("delete", "HF_TOKEN").returncode == 0 and json.loads(cli("list", "--json").stdout) == []
