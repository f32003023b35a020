"""The second audit (issue 35), finding by finding: each test failed on the main it was found on. Quick tier: the
internal and public APIs over real HTTP (`tests.live_api`) on SQLite and PostgreSQL, and the pure decisions."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from service.policy.retry import decide
from service.spec.job import JobSpec
from service.store.models import Checkpoint, EndReason, Job, JobState, Metric
from service.tenancy import attempt_tokens
from tests.live_api import LiveApi, add_attempt, live_api
from tests.service.conftest import db  # noqa: F401 - the fixture

SPEC = {"entrypoint": {"callable": "examples.mlp:train_loop"}, "resources": {"num_workers": 1},
        "retries": {"max_attempts": 1}}  # fmt: skip
ALICE = "alice-token"


@pytest.fixture
def api(db: Engine, tmp_path: Path) -> Iterator[LiveApi]:  # noqa: F811 - the imported fixture
    attempt_tokens.forget_cached_keys()
    with live_api(db, tmp_path, api_tokens={ALICE: {"owner": "alice"}}) as live:
        yield live
    attempt_tokens.forget_cached_keys()


def running_job(engine: Engine, owner: str = "alice", **spec: object) -> str:
    job = Job(name="j", owner=owner, spec=JobSpec.model_validate({**SPEC, **spec}).model_dump(mode="json"),
              state=JobState.RUNNING, attempt=1)  # fmt: skip
    add_attempt(engine, job)
    return job.id


# ---- 1. free retries by claiming a reason -------------------------------------------------------------------------
def test_1_a_job_cannot_claim_a_head_restart_for_itself(api: LiveApi) -> None:
    """A job's attempt token posted `cluster_restarted` as its end: a retry that did not count, as often as it liked
    (a `max_attempts: 1` job reached attempt 8). The dispatcher finds a head restart itself; the claim is refused."""
    job = running_job(api.engine)
    token = api.token(job, 1)
    for reason in ("cluster_restarted", "preempted", "timeout"):
        r = httpx.post(f"{api.url}/internal/v1/attempts/{job}/1/end", json={"reason": reason, "message": "x"},
                       headers={"Authorization": f"Bearer {token}"}, timeout=10)  # fmt: skip
        assert r.status_code == 422, (reason, r.text)
        assert f"a driver cannot record {reason}" in r.text and "reason" in r.text
    ok = httpx.post(f"{api.url}/internal/v1/attempts/{job}/1/end", json={"reason": "worker_lost", "message": "x"},
                    headers={"Authorization": f"Bearer {token}"}, timeout=10)  # fmt: skip
    assert ok.json() == {"recorded": True}


@pytest.mark.parametrize(
    ("reason", "kw"),
    [
        (EndReason.PREEMPTED, {}),
        (EndReason.NODE_DRAINING, {"drain_confirmed": True}),
        (EndReason.NODE_LOST, {"elastic": True, "drain_confirmed": True}),
        (EndReason.CLUSTER_RESTARTED, {}),
    ],
)
def test_1_every_free_retry_has_a_cap_per_job(reason: EndReason, kw: dict) -> None:
    """Ends that cost the job nothing are free only up to `max_free_retries` per job, counted together; past it
    they count like any failure, and a `max_attempts: 1` job ends."""
    base = {"reason": reason, "max_attempts": 1, "backoff_seconds": 5, "max_backoff_seconds": 60,
            "max_free_retries": 10, **kw}  # fmt: skip
    under = decide(**base, attempt=10, preemptions=5, cluster_restarts=4)
    assert under.retry and under.uncounted or reason is EndReason.CLUSTER_RESTARTED and under.retry
    spent = decide(**base, attempt=11, preemptions=6, cluster_restarts=4)
    assert not spent.retry and "10 free retries spent" in spent.why, spent
    # Within the cap, a counted failure still sees its free attempts as not counted.
    assert decide(reason=EndReason.WORKER_LOST, attempt=9, max_attempts=2, backoff_seconds=1, max_backoff_seconds=1,
                  preemptions=8, max_free_retries=10).retry  # fmt: skip


def submit(api: LiveApi, spec: dict) -> httpx.Response:
    return httpx.post(f"{api.url}/v1/jobs", json=spec, headers={"Authorization": f"Bearer {ALICE}"}, timeout=10)


# ---- 6. a checkpoint id past a 32-bit row id ----------------------------------------------------------------------
def test_6_a_checkpoint_id_no_row_can_have_is_refused_at_submission(api: LiveApi) -> None:
    """`checkpoint.resume_from` above 2**31-1 was accepted; on PostgreSQL it then failed every dispatcher tick with
    NumericValueOutOfRange, held its room, ended `infra` (retried) and showed raw SQL in `last_error`."""
    for too_big in ("2147483648", "999999999999999999"):
        r = submit(api, {**SPEC, "checkpoint": {"resume_from": too_big}})
        assert (r.status_code, r.json().get("field")) == (422, "checkpoint.resume_from"), r.text
        assert "from 1 to 2147483647" in r.json()["detail"]
    largest = submit(api, {**SPEC, "checkpoint": {"resume_from": "2147483647"}})
    assert largest.status_code == 201, largest.text


# ---- 12. the shown loss is the last one reported ------------------------------------------------------------------
def test_12_a_report_without_a_loss_keeps_the_last_one_shown(api: LiveApi) -> None:
    """An unchanged HF `run_clm.py` ended SUCCEEDED with `loss: null`: its end-of-training summary report has no
    `loss`, and the job showed the latest report's only. The metric rows stay what each report said."""
    job = running_job(api.engine)
    token = {"Authorization": f"Bearer {api.token(job, 1)}"}
    for body in ({"metrics": {"loss": 0.25}, "step": 3}, {"metrics": {"train_runtime": 5.0}, "step": 4}):
        r = httpx.post(f"{api.url}/internal/v1/attempts/{job}/1/report", json=body, headers=token, timeout=10)
        assert r.json() == {"recorded": True}, r.text
    shown = httpx.get(f"{api.url}/v1/jobs/{job}", headers={"Authorization": f"Bearer {ALICE}"}, timeout=10).json()
    assert shown["loss"] == 0.25 and shown["step"] == 4
    assert shown["latest_metrics"] == {"loss": 0.25, "train_runtime": 5.0}
    losses = httpx.get(f"{api.url}/v1/jobs/{job}/metrics", params={"name": "loss"},
                       headers={"Authorization": f"Bearer {ALICE}"}, timeout=10).json()  # fmt: skip
    assert [(m["step"], m["value"]) for m in losses] == [(3, 0.25)]


# ---- 9. text a job writes is shown as text --------------------------------------------------------------------------
HOSTILE = "[link=https://evil.example]click[/link] [/oops] <!channel> <https://evil.example|docs> &amp;"


def test_9_the_cli_shows_a_jobs_text_as_text(api: LiveApi) -> None:
    """A `checkpoint_uri` (or name, reason, message) holding rich markup crashed `shunter checkpoints`, `status` and
    `events` with MarkupError, or showed a disguised link. Through the real CLI against the real API."""
    from typer.testing import CliRunner

    from api.cli import app
    from service.store.models import Job as JobRow

    job = running_job(api.engine)
    token = {"Authorization": f"Bearer {api.token(job, 1)}"}
    body = {"metrics": {"loss": 0.5}, "step": 2, "checkpoint_uri": f"/ckpt/{HOSTILE}", "keep": 2}
    assert httpx.post(f"{api.url}/internal/v1/attempts/{job}/1/report", json=body, headers=token,
                      timeout=10).json() == {"recorded": True}  # fmt: skip
    with Session(api.engine) as session:  # a name and an error message the job's owner or driver chose
        row = session.get(JobRow, job)
        assert row is not None
        row.name, row.last_error = HOSTILE[:60], HOSTILE
        session.add(row)
        session.commit()

    def compact(text: str) -> str:  # a table folds long cells over lines: compare without layout
        return re.sub(r"[\s│┃]", "", text)

    runner = CliRunner()
    for command in (["checkpoints", job], ["status", job], ["events", job], ["list"]):
        out = runner.invoke(app, [*command, "--server", api.url, "--token", ALICE])
        assert out.exit_code == 0, (command, out.output, out.exception)
        if command[0] in ("checkpoints", "status"):  # shown as written, markup and all
            assert compact("click[/link] [/oops]") in compact(out.output), (command, out.output)
    shown = runner.invoke(app, ["checkpoints", job, "--server", api.url, "--token", ALICE])
    assert compact("[link=https://evil.example]click[/link]") in compact(shown.output)


def test_9_a_slack_body_escapes_what_a_job_wrote() -> None:
    from service.policy.webhook_rules import slack_document

    doc = {"job": {"name": "x <!channel>", "id": "j1", "state_reason": "<https://evil.example|docs> & more"},
           "to_state": "FAILED", "reason": "user_error"}  # fmt: skip
    text = slack_document(doc)["text"]
    assert "<!channel>" not in text and "<https://evil.example|docs>" not in text
    assert "&lt;!channel&gt;" in text and "&lt;https://evil.example|docs&gt; &amp; more" in text


# ---- 8. what leaks to other tenants -------------------------------------------------------------------------------
def test_8_another_owners_job_in_depends_on_is_answered_as_no_job(db: Engine, tmp_path: Path) -> None:  # noqa: F811
    """`depends_on` told another owner's job (403) apart from no job (422): anyone could learn which ids exist."""
    tokens = {ALICE: {"owner": "alice"}, "bob-token": {"owner": "bob"}}
    with live_api(db, tmp_path, api_tokens=tokens) as api:

        def post(token: str, spec: dict) -> httpx.Response:
            return httpx.post(f"{api.url}/v1/jobs", json=spec, headers={"Authorization": f"Bearer {token}"}, timeout=10)

        hers = post(ALICE, SPEC).json()["id"]
        unknown = "j0123456789abcdef"
        theirs, nobodys = (post("bob-token", {**SPEC, "depends_on": [{"job": j}]}) for j in (hers, unknown))
        assert (theirs.status_code, nobodys.status_code) == (422, 422)
        assert theirs.json()["detail"].replace(hers, "ID") == nobodys.json()["detail"].replace(unknown, "ID")
        assert theirs.json()["field"] == nobodys.json()["field"] == "depends_on[0].job"


def test_8_a_node_kept_out_names_only_the_callers_own_jobs(db: Engine, tmp_path: Path) -> None:  # noqa: F811
    """`/v1/cluster` `excluded_nodes[].jobs` listed other owners' job ids."""
    from service.store.models import NodeFault

    tokens = {ALICE: {"owner": "alice"}, "bob-token": {"owner": "bob"}, "ops-token": {"owner": "ops", "admin": True}}
    owners = {"alice": [], "bob": []}
    with Session(db) as session:
        for owner in ("alice", "alice", "bob"):  # three jobs of two owners failed their pre-flight on node n1
            job = Job(name="j", owner=owner, spec=JobSpec.model_validate(SPEC).model_dump(mode="json"),
                      state=JobState.FAILED, attempt=1)  # fmt: skip
            session.add(job)
            session.flush()
            session.add(NodeFault(node_id="n1", job_id=job.id, attempt=1, reason="preflight_failed"))
            owners[owner].append(job.id)
        session.commit()
    with live_api(db, tmp_path, api_tokens=tokens) as api:

        def seen(token: str) -> list[dict]:
            view = httpx.get(f"{api.url}/v1/cluster", headers={"Authorization": f"Bearer {token}"}, timeout=10)
            return view.json()["excluded_nodes"]

        (alice,), (bob,), (ops,) = seen(ALICE), seen("bob-token"), seen("ops-token")
        assert sorted(alice["jobs"]) == sorted(owners["alice"]) and bob["jobs"] == owners["bob"]
        assert sorted(ops["jobs"]) == sorted(owners["alice"] + owners["bob"])
        assert alice["why"] == bob["why"] == "3 jobs failed there (preflight_failed)"


@pytest.mark.parametrize("same_owner", [False, True])
def test_8_a_preempted_job_is_told_another_owners_job_id_never(db: Engine, tmp_path: Path, same_owner: bool) -> None:  # noqa: F811
    """A preemption event named the job it yielded to, another owner's included. Its own owner's job it still names.
    A real dispatcher on the noop backend (a 2-CPU cluster that each running job fills)."""
    from service.config.settings import Settings
    from service.dispatch.dispatcher import Dispatcher
    from service.lifecycle.jobs import submit
    from service.store.models import JobEvent
    from service.tenancy.auth import Caller
    from tests.service.test_poison import Backend, ended, run_until

    backend = Backend(tmp_path / "noop", cpus=2, run_seconds=1.0)
    backend.held_per_job = 2
    conf = Settings(database_url="sqlite://", data_dir=tmp_path / "data", storage_uri=str(tmp_path / "ckpt"),
                    lease_seconds=30, queues={"default": {"preemption": True}}, preemption_grace_seconds=0)  # fmt: skip
    disp = Dispatcher(engine=db, settings=conf, ray=backend, owner="d1")

    def add(owner: str, priority: int) -> str:
        spec = JobSpec.model_validate({**SPEC, "resources": {"num_workers": 2}, "priority": priority})
        with Session(db) as session:
            job, _ = submit(session, spec, caller=Caller(owner))
            session.commit()
            return job.id

    try:
        victim = add("bob", 0)
        disp.tick()
        urgent = add("bob" if same_owner else "alice", 100)
        run_until(disp, ended(db, victim, urgent))
    finally:
        disp._pool.shutdown(wait=True)
    with Session(db) as session:
        (told,) = session.exec(select(JobEvent).where(JobEvent.job_id == victim,
                                                      JobEvent.reason == "preemption_requested")).all()  # fmt: skip
    if same_owner:
        assert told.message == f"making room for {urgent} (priority 100)"
    else:
        assert told.message == "making room for another owner's job (priority 100)"


def test_8_metrics_labelled_by_owner_are_the_callers_own_unless_admin(db: Engine, tmp_path: Path) -> None:  # noqa: F811
    """`/metrics` showed every owner's CPU- and GPU-seconds to any token."""
    from prometheus_client.parser import text_string_to_metric_families

    from tests.api.test_usage import _history

    _history(db)  # alice, bob and carol each ran attempts
    tokens = {ALICE: {"owner": "alice"}, "ops-token": {"owner": "ops", "admin": True}}
    with live_api(db, tmp_path, api_tokens=tokens) as api:

        def owners(token: str) -> set[str]:
            text = httpx.get(f"{api.url}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=10).text
            return {s.labels["owner"] for f in text_string_to_metric_families(text) for s in f.samples
                    if "owner" in s.labels}  # fmt: skip

        assert owners(ALICE) == {"alice"}
        assert owners("ops-token") == {"alice", "bob", "carol"}


def test_8_a_refused_webhook_does_not_say_what_an_internal_name_resolves_to() -> None:
    """A notification's error said `vm resolves to 127.0.0.1 ...`: any owner could map internal names to addresses
    by naming them in a webhook. The owner reads that it was refused; the address goes to the operator's log."""
    from service.workflows.webhooks import Refused, pinned_address

    with pytest.raises(Refused) as refused:
        pinned_address("localhost", 80, allow_private=False)
    said = str(refused.value)
    assert said.startswith("refused: localhost resolves to an address that is not public")
    assert "127.0.0.1" not in said and "::1" not in said


# ---- 7. code archives: bounded unpacked size and entries ------------------------------------------------------------
def _zip(members: dict[str, bytes]) -> bytes:
    import io
    import zipfile

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def test_7_a_code_archive_that_unpacks_too_big_or_too_many_is_refused_unread(db: Engine, tmp_path: Path) -> None:  # noqa: F811
    """A 1 MiB deflate bomb cost 0.6 s of the API's CPU in testzip(), a 200,000-entry zip 3 s, and either was kept.
    Both are refused with a 413 from the archive's directory (the sizes it declares), before a member is read."""
    bomb = _zip({"a.bin": b"\0" * (64 << 20)})  # 64 MiB of zeros: ~64 KiB deflated
    many = _zip({f"f{i}.py": b"" for i in range(60)})
    fine = _zip({"train.py": b"print('hi')\n"})
    headers = {"Authorization": f"Bearer {ALICE}", "Content-Type": "application/zip"}
    with live_api(db, tmp_path, api_tokens={ALICE: {"owner": "alice"}}, max_code_unpacked_bytes=32 << 20,
                  max_code_entries=50, storage_uri=str(tmp_path / "storage")) as api:  # fmt: skip
        r = httpx.post(f"{api.url}/v1/code", content=bomb, headers=headers, timeout=30)
        assert (r.status_code, r.json()["field"]) == (413, "body"), r.text
        assert "unpack to at most 33554432 bytes, this one to 67108864" in r.json()["detail"]
        r = httpx.post(f"{api.url}/v1/code", content=many, headers=headers, timeout=30)
        assert r.status_code == 413 and "at most 50 members, this one holds 60" in r.json()["detail"], r.text
        assert httpx.post(f"{api.url}/v1/code", content=fine, headers=headers, timeout=30).status_code == 201
    assert len(list((tmp_path / "storage" / "code").rglob("*.zip"))) == 1  # only the fine one was kept


# ---- 10. /docs without a CDN ---------------------------------------------------------------------------------------
def test_10_the_api_docs_load_nothing_from_another_origin(api: LiveApi) -> None:
    """`/docs` loaded `swagger-ui-dist@5` from a CDN: no SRI, on the origin where `/ui` keeps its token, and a blank
    page on an air-gapped cluster. Every script, style and image of the page is now the service's own."""
    import re as regex

    page = httpx.get(f"{api.url}/docs", timeout=10)
    assert page.status_code == 200 and "SwaggerUIBundle" in page.text
    loaded = regex.findall(r"""(?:src|href)\s*=\s*["']([^"']+)["']""", page.text)
    assert loaded and all(url.startswith("/") and not url.startswith("//") for url in loaded), loaded
    assert "http://" not in page.text and "https://" not in page.text.replace("https://swagger.io", "")
    assert "default-src 'none'" in page.headers["content-security-policy"]
    for url in loaded:
        asset = httpx.get(f"{api.url}{url}", timeout=10)
        assert asset.status_code == 200 and len(asset.content) > 100, url
    assert httpx.get(f"{api.url}/docs/assets/index.html", timeout=10).status_code == 404  # only what the page loads
    assert httpx.get(f"{api.url}/redoc", timeout=10).status_code == 404  # ReDoc came from a CDN only


# ---- 2. reads that wait hold no connection, and one caller's are capped ---------------------------------------------
def test_2_log_reads_that_wait_hold_no_connection_and_are_capped_per_caller(
    db: Engine,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a driver's last word and before its Ray Job exits, a log read waits (up to 15 s) for the whole log. It
    slept holding its request's pooled connection: 45 reads stalled another owner's GET /v1/jobs for 29.9 s on
    SQLite; 20 held all of PostgreSQL's pool. Now a waiting read holds no connection between its looks, and one
    caller may have `max_streams_per_caller` waiting (429 beyond), while others are served."""
    import threading

    from sqlalchemy import update

    import api.routes.job_logs as job_routes
    from service.store.models import Attempt, utcnow

    monkeypatch.setattr(job_routes, "LATE_LOG_WAIT_SECONDS", 6.0)
    tokens = {ALICE: {"owner": "alice"}, "mallory-token": {"owner": "mallory"}}
    with live_api(db, tmp_path, api_tokens=tokens, max_streams_per_caller=3) as api:
        job = running_job(api.engine, owner="mallory")
        with Session(api.engine) as session:  # the driver said its last word; Ray's end has not come yet
            ended = {"driver_ended_at": utcnow(), "ended_at": utcnow()}  # (the dispatcher ends it on that word)
            session.exec(update(Attempt).where(Attempt.job_id == job).values(**ended))  # type: ignore[call-overload]
            session.commit()
        answers: list[int] = []

        def read() -> None:
            r = httpx.get(f"{api.url}/v1/jobs/{job}/logs", headers={"Authorization": "Bearer mallory-token"},
                          timeout=30)  # fmt: skip
            answers.append(r.status_code)

        readers = [threading.Thread(target=read) for _ in range(6)]
        for t in readers:
            t.start()
        wait_for_three_refused = time.monotonic() + 5
        while answers.count(429) < 3 and time.monotonic() < wait_for_three_refused:
            time.sleep(0.05)
        assert sorted(answers) == [429, 429, 429], answers  # three wait; three are refused at once
        held = []
        for _ in range(20):  # while three reads wait: their looks are short sessions, nothing is held between
            held.append(api.engine.pool.checkedout())
            time.sleep(0.05)
        others = httpx.get(f"{api.url}/v1/jobs", headers={"Authorization": f"Bearer {ALICE}"}, timeout=30)
        assert others.status_code == 200
        still_waiting = sum(t.is_alive() for t in readers)
        for t in readers:
            t.join()
    assert min(held) == 0, held
    assert still_waiting == 3  # alice was answered while they waited, not after
    assert sorted(answers) == [200, 200, 200, 429, 429, 429]


# ---- 3. a list does not multiply specs -------------------------------------------------------------------------------
def test_3_a_job_list_comes_without_specs_unless_asked_for_a_small_page(api: LiveApi) -> None:
    """`GET /v1/jobs?limit=100` returned 39 MiB after one large sweep: every item carried its whole spec."""
    big = {"config": {"blob": "x" * 200_000}}
    auth = {"Authorization": f"Bearer {ALICE}"}
    ids = [submit(api, {**SPEC, **big}).json()["id"] for _ in range(3)]
    plain = httpx.get(f"{api.url}/v1/jobs", params={"limit": 100}, headers=auth, timeout=10)
    assert plain.status_code == 200 and [j["id"] for j in plain.json()["items"]] == ids[::-1]
    assert all(j["spec"] is None for j in plain.json()["items"]) and len(plain.content) < 20_000
    asked = httpx.get(f"{api.url}/v1/jobs", params={"limit": 20, "include": "spec"}, headers=auth, timeout=10)
    assert [j["spec"]["config"]["blob"] == big["config"]["blob"] for j in asked.json()["items"]] == [True] * 3
    too_many = httpx.get(f"{api.url}/v1/jobs", params={"limit": 21, "include": "spec"}, headers=auth, timeout=10)
    assert (too_many.status_code, too_many.json()["field"]) == (422, "limit"), too_many.text
    one = httpx.get(f"{api.url}/v1/jobs/{ids[0]}", headers=auth, timeout=10).json()
    assert one["spec"]["config"]["blob"] == big["config"]["blob"]  # the job itself keeps it (the page's spec pane)


# ---- 4. a job's events, checkpoints and metrics come in pages -------------------------------------------------------
def test_4_events_checkpoints_and_metrics_come_in_pages_that_the_client_follows(api: LiveApi) -> None:
    """A job writes as many events, checkpoints and metric points as it likes, and each list was answered whole.
    Now a page holds at most `limit` rows (a default when not asked), oldest first, and a full page names where the
    next starts in `X-Next-After`; the client (so the CLI) and the web page follow the pages to the end."""
    from api.client import Client
    from service.store.models import JobEvent

    job = running_job(api.engine)
    with Session(api.engine) as session:
        for i in range(5):
            session.add(JobEvent(job_id=job, kind="info", reason=f"r{i}"))
            session.add(Checkpoint(job_id=job, attempt=1, step=i, uri=f"/ckpt/{i}"))
            session.add(Metric(job_id=job, attempt=1, step=i, name="loss", value=float(i)))
            session.add(Metric(job_id=job, attempt=1, step=i, name="lr", value=0.1))
        session.commit()
    auth = {"Authorization": f"Bearer {ALICE}"}
    for path, params, key in (
        ("events", {}, "reason"),
        ("checkpoints", {}, "step"),
        ("metrics", {"name": "loss"}, "step"),
    ):
        url = f"{api.url}/v1/jobs/{job}/{path}"
        every = httpx.get(url, params=params, headers=auth, timeout=10)
        assert every.status_code == 200 and "X-Next-After" not in every.headers, (path, every.headers)
        pages, after = [], None
        while True:
            r = httpx.get(url, params={**params, "limit": 2, **({"after": after} if after else {})}, headers=auth,
                          timeout=10)  # fmt: skip
            assert r.status_code == 200 and len(r.json()) <= 2, (path, r.text)
            pages.append([row[key] for row in r.json()])
            after = r.headers.get("X-Next-After")
            if after is None:
                break
        assert sum(pages, []) == [row[key] for row in every.json()] and len(pages) == 3, (path, pages)
        too_big = httpx.get(url, params={**params, "limit": 10**6}, headers=auth, timeout=10)
        assert (too_big.status_code, too_big.json()["field"]) == (422, "limit"), (path, too_big.text)
    with Client(api.url, token=ALICE) as c:
        c.http.params = c.http.params.merge({"limit": 2})  # every read in pages of 2: the client follows them
        assert [e.reason for e in c.events(job)][-5:] == [f"r{i}" for i in range(5)]
        assert [k.step for k in c.checkpoints(job)] == list(range(5))
        assert [(m.step, m.value) for m in c.metrics(job, name="loss")] == [(i, float(i)) for i in range(5)]


def _report(api: LiveApi, job: str, body: dict) -> httpx.Response:
    token = {"Authorization": f"Bearer {api.token(job, 1)}"}
    return httpx.post(f"{api.url}/internal/v1/attempts/{job}/1/report", json=body, headers=token, timeout=10)


def _told(api: LiveApi, job: str, reason: str) -> int:
    from service.store.models import JobEvent

    with Session(api.engine) as session:
        return len(session.exec(select(JobEvent).where(JobEvent.job_id == job, JobEvent.reason == reason)).all())


def test_4_an_attempt_that_reports_too_fast_is_refused_with_a_429_and_told_once(db: Engine, tmp_path: Path) -> None:  # noqa: F811
    """Four threads of one job posting 256 metrics a report wrote ~6,100 rows a second. Now each attempt has a rate
    (a bucket of `attempt_rows_burst`, refilled at `attempt_rows_per_second`): beyond it a 429 with Retry-After, and
    one event on the job's timeline however often it is refused; other attempts have buckets of their own."""
    attempt_tokens.forget_cached_keys()
    with live_api(db, tmp_path, api_tokens={ALICE: {"owner": "alice"}}, attempt_rows_per_second=5.0,
                  attempt_rows_burst=300) as api:  # fmt: skip
        job, other = running_job(api.engine), running_job(api.engine)
        wide = {"metrics": {f"m{k}": 1.0 for k in range(150)}, "step": 1}
        assert [_report(api, job, wide).status_code for _ in range(2)] == [200, 200]
        for _ in range(3):
            refused = _report(api, job, wide)
            assert refused.status_code == 429 and refused.json()["code"] == "attempt_rate_limited", refused.text
            assert int(refused.headers["Retry-After"]) >= 20  # 150 rows at 5 a second
        assert _told(api, job, "attempt_rate_limited") == 1
        assert _report(api, other, wide).status_code == 200  # its own bucket
        with Session(api.engine) as session:
            assert len(session.exec(select(Metric).where(Metric.job_id == job)).all()) == 300
    attempt_tokens.forget_cached_keys()


def test_4_an_attempt_that_wrote_its_rows_is_refused_whatever_it_sends_and_told_once(
    db: Engine,  # noqa: F811 - the imported fixture
    tmp_path: Path,
) -> None:
    """Metric rows, checkpoint records and events were unbounded per attempt. Now the attempt's own reports write at
    most `attempt_max_rows` rows, counted in the database (so several API processes never pass it together): the
    report that would pass it is refused whole (429, `attempt_row_cap`), so are later metrics, checkpoints and
    warnings, and the job's timeline says so once."""
    attempt_tokens.forget_cached_keys()
    with live_api(db, tmp_path, api_tokens={ALICE: {"owner": "alice"}}, attempt_rows_per_second=1e6,
                  attempt_max_rows=300) as api:  # fmt: skip
        job = running_job(api.engine)
        hundred = {"metrics": {f"m{k}": 1.0 for k in range(100)}, "step": 1}
        assert [_report(api, job, hundred | {"step": i}).status_code for i in range(3)] == [200, 200, 200]
        token = {"Authorization": f"Bearer {api.token(job, 1)}"}
        for refused in (_report(api, job, {"metrics": {"loss": 1.0}, "step": 4}),
                        _report(api, job, {"metrics": {}, "step": 5, "checkpoint_uri": "/ckpt/5"}),
                        httpx.post(f"{api.url}/internal/v1/attempts/{job}/1/warning", headers=token, timeout=10,
                                   json={"code": "slow", "message": "slow"})):  # fmt: skip
            assert refused.status_code == 429 and refused.json()["code"] == "attempt_row_cap", refused.text
        assert _told(api, job, "attempt_row_cap") == 1
        with Session(api.engine) as session:
            assert len(session.exec(select(Metric).where(Metric.job_id == job)).all()) == 300
            assert session.exec(select(Checkpoint).where(Checkpoint.job_id == job)).all() == []
            assert session.get(Job, job).step == 2  # the refused reports moved nothing
    attempt_tokens.forget_cached_keys()


def test_4_a_report_of_an_attempt_with_no_row_is_stored_uncounted(db: Engine, tmp_path: Path) -> None:  # noqa: F811
    """The dispatcher makes an attempt's row as it admits it; a job written without one (by a tool, or a test of the
    worker side) has nothing to count against, and its reports are stored as before, not refused as over a cap."""
    attempt_tokens.forget_cached_keys()
    with live_api(db, tmp_path, attempt_max_rows=300) as api:
        with Session(api.engine) as session:
            job = Job(name="j", owner="anonymous", spec=JobSpec.model_validate(SPEC).model_dump(mode="json"),
                      state=JobState.RUNNING, attempt=1)  # fmt: skip
            session.add(job)
            session.commit()
            job_id = job.id
        r = _report(api, job_id, {"metrics": {"loss": 0.5}, "step": 1})
        assert r.status_code == 200 and r.json() == {"recorded": True}, r.text
    attempt_tokens.forget_cached_keys()


@pytest.mark.parametrize(
    ("metrics", "checkpoint", "progress", "rows"),
    [({"loss": 1.0, "lr": 0.1}, None, True, 2), ({"step": 3, "loss": 1.0}, None, True, 1),
     ({"loss": 1.0, "note": "text", "flag": True, "bad": float("nan")}, None, True, 1), ({}, "/ckpt/1", True, 2),
     ({"step": 1, "loss": 1.0}, "/ckpt/1", True, 3), ({"loss": 1.0}, "/ckpt/1", False, 2),
     ({"loss": 1.0}, None, False, 0)],
)  # fmt: skip
def test_4_the_rate_and_the_total_count_the_rows_a_report_writes(
    metrics: dict, checkpoint: str | None, progress: bool, rows: int
) -> None:
    """The per-attempt rate (API) and the total (database) count one report alike: a row per stored number but
    `step`, two for a checkpoint (the rate counted every metric name given, `step` and text included)."""
    from service.lifecycle.reports import report_rows

    assert report_rows(metrics, checkpoint, progress=progress) == rows


def test_3_parsed_specs_are_kept_within_a_byte_bound() -> None:
    """The dispatcher's and the estimate's parsed specs were bounded by count alone (50,000 entries, of any size).
    Now by the bytes of the specs they hold: least recently used first out, and one larger than the bound not kept."""
    from service.store.spec_cache import SpecCache

    cache: SpecCache[str | None] = SpecCache(max_bytes=1000)
    for k in range(5):
        cache.put(k, f"v{k}", 300)
    assert len(cache) == 3 and cache.bytes == 900 and cache.get(0) == (False, None)
    assert cache.get(2) == (True, "v2")  # now the most recently used: 3 goes first
    cache.put("bad", None, 300)  # a spec that does not parse is kept as such
    assert cache.get(3) == (False, None) and cache.get("bad") == (True, None) and cache.get(2) == (True, "v2")
    cache.put("huge", "h", 1001)
    assert cache.get("huge") == (False, None) and cache.bytes <= 1000


def test_3_the_estimates_parsed_specs_stay_within_their_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    from service import estimate
    from service.store.spec_cache import SpecCache, stored_size

    monkeypatch.setattr(estimate, "_specs", SpecCache(max_bytes=64 << 10))
    big = {**SPEC, "config": {"blob": "x" * (20 << 10)}}
    jobs = [Job(id=f"j{k}", name="j", owner="o", spec=big, spec_hash=f"h{k}") for k in range(10)]
    for job in jobs:
        parsed = estimate._spec(job)
        assert parsed is not None and parsed.config["blob"] == big["config"]["blob"]
    assert estimate._specs.bytes <= 64 << 10 and len(estimate._specs) == (64 << 10) // stored_size(big)
    assert estimate._spec(jobs[-1]) is estimate._spec(jobs[-1])  # kept: parsed once


def test_3_a_sweep_whose_members_would_store_too_many_bytes_is_refused_before_any_is_made(
    db: Engine,  # noqa: F811 - the imported fixture
    tmp_path: Path,
) -> None:
    """One 447 KB `POST /v1/sweeps` (count 100) stored 43 MiB of member specs. Now the members' bytes together have
    a bound (`max_sweep_bytes`): beyond it a 422 naming `base`, with nothing stored; under it the sweep is made."""
    attempt_tokens.forget_cached_keys()
    base = {**SPEC, "config": {"blob": "x" * (40 << 10)}}  # ~40 KiB a member
    with live_api(db, tmp_path, api_tokens={ALICE: {"owner": "alice"}}, max_sweep_bytes=1 << 20) as api:
        auth = {"Authorization": f"Bearer {ALICE}"}
        refused = httpx.post(f"{api.url}/v1/sweeps", json={"base": base, "count": 30}, headers=auth, timeout=30)
        assert refused.status_code == 422 and refused.json()["field"] == "base", refused.text
        assert "max_sweep_bytes" in refused.json()["detail"]
        with Session(api.engine) as session:
            assert session.exec(select(Job)).all() == []
        made = httpx.post(f"{api.url}/v1/sweeps", json={"base": base, "count": 20}, headers=auth, timeout=30)
        assert made.status_code == 201, made.text
    attempt_tokens.forget_cached_keys()


def test_3_a_spec_cache_shared_by_threads_keeps_its_bound() -> None:
    """The dispatcher's reconcile threads and the API's request threads share one cache: gets and puts at once never
    fail (an entry evicted between a lookup and its reordering) and the bytes counted stay those held."""
    import sys
    import threading

    from service.store.spec_cache import SpecCache

    cache: SpecCache[int] = SpecCache(max_bytes=5000)
    failures: list[BaseException] = []

    def churn(seed: int) -> None:
        try:
            for i in range(20_000):
                key = (seed * 7 + i) % 64
                cache.get(key)
                cache.put(key, i, 100 + key * 10)
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    threads = [threading.Thread(target=churn, args=(n,)) for n in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between any two bytecodes, as a loaded machine may make them
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert failures == []
    assert cache.bytes <= 5000 and cache.bytes == sum(size for _, size in cache._items.values())


# ---- 11. a running attempt's Ray log is read by range, never whole ---------------------------------------------------
def _write_log(path: Path, size: int) -> bytes:
    """A log of about `size` bytes of numbered lines, written a MiB at a time; returns its sha256."""
    import hashlib

    digest = hashlib.sha256()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as out:
        n = written = 0
        while written < size:
            chunk = b"".join(b"step %09d: loss 0.%06d and some words a training loop prints\n" % (n + i, i)
                             for i in range(16_000))  # fmt: skip
            n += 16_000
            out.write(chunk)
            digest.update(chunk)
            written += len(chunk)
    return digest.digest()


def test_11_a_running_attempts_ray_log_is_read_by_range_in_bounded_memory(tmp_path: Path) -> None:
    """The API fetched a running attempt's whole Ray log for any read (Ray's Jobs API answers it whole, in one JSON
    string) and cached it whole; the dispatcher held whole logs too. Now a ranged read asks Ray's agent for those bytes
    only (HTTP Range on the driver's log file): against a 50 MB log, the bytes are the file's, Ray sends little more
    than asked, and the peak of Python memory stays a few blocks (`ray_log_block_bytes`), a whole read included."""
    import hashlib
    import tracemalloc

    from service.backends.ray_jobs import RayJobs
    from service.store.db import make_engine
    from service.store.migrate import upgrade
    from tests.ray_log_http import ray_log_http

    engine = make_engine(f"sqlite:///{tmp_path / 'api.db'}")
    upgrade(engine)
    with ray_log_http(tmp_path / "ray-logs") as ray_http:
        ray = RayJobs(ray_http.dashboard_url)
        with live_api(engine, tmp_path, ray=ray, api_tokens={ALICE: {"owner": "alice"}}) as api:
            job = running_job(engine)
            sid = f"shunter-{job}-1"
            ray_http.jobs[sid] = "RUNNING"
            path = ray_http.log_path(sid)
            whole_digest = _write_log(path, 50 << 20)
            size = path.stat().st_size
            data = path.read_bytes()
            last_three = b"\n".join(data.rsplit(b"\n", 4)[1:4]) + b"\n"
            tail_start = size - len(last_three)
            middle = data[25_000_000:26_000_000]
            del data
            url, auth = f"{api.url}/v1/jobs/{job}/logs", {"Authorization": f"Bearer {ALICE}"}

            tracemalloc.start()
            try:
                r = httpx.get(url, params={"offset": 25_000_000, "limit_bytes": 1_000_000}, headers=auth, timeout=60)
                assert r.status_code == 200, r.text[:300]
                assert r.content == middle and r.headers["X-Next-Offset"] == "26000000"
                r = httpx.get(url, params={"tail": 3}, headers=auth, timeout=60)
                assert r.content == last_three and r.headers["X-Next-Offset"] == str(size)
                r = httpx.get(url, params={"offset": tail_start}, headers=auth, timeout=60)
                assert r.content == last_three and r.headers["X-Next-Offset"] == str(size)
                r = httpx.get(url, params={"offset": size + 10}, headers=auth, timeout=60)
                assert r.content == b"" and r.headers["X-Next-Offset"] == str(size)
                ranged_sent = sum(ray_http.sent.values())
                streamed = hashlib.sha256()
                with httpx.stream("GET", url, headers=auth, timeout=60) as whole:  # all of it, a chunk at a time
                    assert whole.headers["X-Next-Offset"] == str(size)
                    for chunk in whole.iter_bytes():
                        streamed.update(chunk)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
        ray.close()
    engine.dispose()
    assert streamed.digest() == whole_digest
    # The ranged reads above asked Ray for 1 MB and two tails: a block or two each, never the log.
    assert ranged_sent < 8 << 20, dict(ray_http.sent)
    assert ray_http.sent["jobs_api"] == 0 and ray_http.sent["state_api"] == 0, dict(ray_http.sent)
    assert peak < 24 << 20, f"reading a 50 MB Ray log peaked at {peak / 2**20:.0f} MiB of Python memory"
