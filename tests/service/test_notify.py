"""Notifications (issue 18): the pure rules by table, the outbox on SQLite and PostgreSQL, and delivery to a real
HTTP receiver on 127.0.0.1 (retries, signatures, redirects, refused addresses, a slow receiver beside a fast one)."""

from __future__ import annotations

import hashlib
import hmac
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from api.app import create_app
from service.config.settings import Settings
from service.core.errors import InvalidSpec, StaleWrite
from service.lifecycle.jobs import submit
from service.lifecycle.state import transition
from service.policy.webhook_rules import (
    Outcome,
    RetryPolicy,
    address_problem,
    after_attempt,
    backoff,
    event_document,
    render,
    sign,
    verify,
)
from service.runtime import Runtime
from service.spec.job import JobSpec
from service.spec.notify import DEFAULT_EVENTS, STATE_NAMES, ClusterWebhook
from service.store.models import Job, JobState
from service.store.notify_tables import Notification, NotifySecret
from service.tenancy.auth import Caller
from service.workflows import notifications as notify
from service.workflows.webhooks import Sender, owner_in_flight, pinned_address
from tests.conftest import wait_for
from tests.service.webhook_receiver import running_receiver

SECRET = "s3cret-s3cret-s3cret"
CLUSTER_SECRET = "cluster-secret-0123456789"
S = JobState


# ---- pure rules ---------------------------------------------------------------------------------------------------
def test_signature_is_hmac_sha256_of_time_dot_body() -> None:
    body = b'{"id":"evt_1"}'
    expected = hmac.new(SECRET.encode(), b"1700000000." + body, hashlib.sha256).hexdigest()
    assert sign(SECRET, body, timestamp=1700000000) == f"t=1700000000,v1={expected}"


@pytest.mark.parametrize(
    ("secret", "body", "header_of", "now", "ok"),
    [
        (SECRET, b"{}", lambda: sign(SECRET, b"{}", timestamp=1000), 1000, True),
        (SECRET, b"{}", lambda: sign(SECRET, b"{}", timestamp=1000), 1299, True),  # within the tolerance
        (SECRET, b"{}", lambda: sign(SECRET, b"{}", timestamp=1000), 1301, False),  # a replay, too late
        (SECRET, b"{}", lambda: sign(SECRET, b"{}", timestamp=1000), 699, False),  # from the future
        ("another-secret-xyz", b"{}", lambda: sign(SECRET, b"{}", timestamp=1000), 1000, False),  # another tenant's
        (SECRET, b'{"x":1}', lambda: sign(SECRET, b"{}", timestamp=1000), 1000, False),  # body changed
        (SECRET, b"{}", lambda: sign(SECRET, b"{}", timestamp=1000).replace("t=1000", "t=1001"), 1000, False),
        (SECRET, b"{}", lambda: "t=1000," + sign("old-secret-0123456", b"{}", timestamp=1000).split(",")[1]
         + "," + sign(SECRET, b"{}", timestamp=1000).split(",")[1], 1000, True),  # two v1 values: one is right
        (SECRET, b"{}", lambda: "", 1000, False),
        (SECRET, b"{}", lambda: "v1=abc", 1000, False),
        (SECRET, b"{}", lambda: "t=abc,v1=abc", 1000, False),
    ],
)  # fmt: skip
def test_verify(secret: str, body: bytes, header_of: Any, now: float, ok: bool) -> None:
    assert verify(secret, body, header_of(), now=now) is ok


@pytest.mark.parametrize(
    ("address", "allowed"),
    [
        ("93.184.215.14", True),
        ("8.8.8.8", True),
        ("2606:4700::6810:85e5", True),
        ("127.0.0.1", False),
        ("127.8.9.10", False),
        ("0.0.0.0", False),
        ("10.1.2.3", False),
        ("172.16.0.1", False),
        ("172.31.255.255", False),
        ("192.168.1.1", False),
        ("169.254.169.254", False),  # cloud metadata
        ("100.64.0.1", False),  # shared address space (carrier NAT)
        ("192.0.2.1", False),  # documentation
        ("224.0.0.1", False),
        ("240.0.0.1", False),
        ("255.255.255.255", False),
        ("::1", False),
        ("::", False),
        ("fe80::1", False),
        ("fe80::1%eth0", False),
        ("fc00::1", False),
        ("fd12:3456::1", False),
        ("ff02::1", False),
        ("::ffff:127.0.0.1", False),  # IPv4-mapped loopback
        ("::ffff:10.0.0.1", False),
        ("::ffff:169.254.169.254", False),
        ("::ffff:8.8.8.8", True),
        ("64:ff9b::a9fe:a9fe", False),  # NAT64 of 169.254.169.254
        ("2002:7f00:1::", False),  # 6to4 of 127.0.0.1
        ("not-an-ip", False),
    ],
)
def test_address_checks(address: str, allowed: bool) -> None:
    problem = address_problem(address)
    assert (problem is None) is allowed, problem


POLICY = RetryPolicy(max_attempts=5, base_seconds=2.0, cap_seconds=10.0)


@pytest.mark.parametrize(
    ("attempts", "jitter", "seconds"),
    [(1, 0.0, 1.0), (1, 1.0, 2.0), (2, 0.0, 2.0), (2, 1.0, 4.0), (3, 0.5, 6.0), (4, 1.0, 10.0), (9, 1.0, 10.0),
     (9, 0.0, 5.0), (1000, 1.0, 10.0), (1, 7.0, 2.0), (1, -1.0, 1.0)],
)  # fmt: skip
def test_backoff_doubles_to_the_cap_with_jitter_in_the_upper_half(attempts: int, jitter: float, seconds: float) -> None:
    assert backoff(attempts, POLICY, jitter=jitter) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("attempts", "ok", "permanent", "outcome"),
    [
        (1, True, False, Outcome("delivered")),
        (5, True, False, Outcome("delivered")),
        (1, False, False, Outcome("pending", 2.0)),
        (4, False, False, Outcome("pending", 10.0)),
        (5, False, False, Outcome("failed")),  # the last allowed try
        (1, False, True, Outcome("failed")),  # a refused address is not tried again
    ],
)
def test_after_attempt(attempts: int, ok: bool, permanent: bool, outcome: Outcome) -> None:
    assert after_attempt(attempts=attempts, ok=ok, permanent=permanent, policy=POLICY, jitter=1.0) == outcome


def test_state_names_are_the_job_states() -> None:
    assert tuple(s.value for s in JobState) == STATE_NAMES
    assert set(DEFAULT_EVENTS) == {s.value for s in JobState if s.is_terminal}


def test_slack_body() -> None:
    from datetime import datetime, timezone

    job = {"id": "j1", "name": "pretrain", "state_reason": "user_error: boom"}
    doc = event_document(event_id="evt_1", job=job, from_state="RUNNING", to_state="FAILED", reason="user_error",
                         message=None, at=datetime(2026, 1, 1, tzinfo=timezone.utc))  # fmt: skip
    assert render(doc, "slack") == '{"text":":x: shunter job *pretrain* (`j1`) is FAILED: user_error: boom"}'
    assert render(doc, "json").startswith('{"at":"2026-01-01T00:00:00+00:00","from_state":"RUNNING"')


BASE = {"entrypoint": {"callable": "a:b"}}


@pytest.mark.parametrize(
    ("notify_value", "field"),
    [
        ([{"url": "ftp://example.com/x"}], "notify.0.url"),
        ([{"url": "example.com/x"}], "notify.0.url"),
        ([{"url": "http:///x"}], "notify.0.url"),
        ([{"url": "https://user:pw@example.com/"}], "notify.0.url"),
        ([{"url": "https://example.com:99999/"}], "notify.0.url"),
        ([{"url": "https://example.com/a b"}], "notify.0.url"),
        ([{"url": "https://example.com/" + "a" * 2100}], "notify.0.url"),
        ([{"url": "https://example.com/", "events": ["DONE"]}], "notify.0.events"),
        ([{"url": "https://example.com/", "events": []}], "notify.0.events"),
        ([{"url": "https://example.com/", "events": ["FAILED", "FAILED"]}], "notify.0.events"),
        ([{"url": "https://example.com/", "secret": "short"}], "notify.0.secret"),
        ([{"url": "https://example.com/", "secret": "0123456789abcdef\x00"}], "notify.0.secret"),  # PostgreSQL: no NUL
        ([{"url": "https://example.com/", "secret": "0123456789abcdef\n"}], "notify.0.secret"),
        ([{"url": "https://example.com/", "format": "xml"}], "notify.0.format"),
        ([{"url": "https://example.com/", "retries": 3}], "notify.0.retries"),
        ([{"url": "https://example.com/"}] * 11, "notify"),
    ],
)
def test_bad_notify_entries_name_the_field(notify_value: Any, field: str) -> None:
    with pytest.raises(ValidationError) as err:
        JobSpec.model_validate({**BASE, "notify": notify_value})
    assert ".".join(str(p) for p in err.value.errors()[0]["loc"]) == field


def test_the_secret_is_never_dumped_nor_shown() -> None:
    spec = JobSpec.model_validate({**BASE, "notify": [{"url": "https://example.com/h", "secret": SECRET}]})
    assert spec.notify[0].secret == SECRET
    assert SECRET not in spec.model_dump_json() and SECRET not in repr(spec) and SECRET not in str(spec.model_dump())
    assert spec.model_dump(mode="json")["notify"] == [
        {"url": "https://example.com/h", "events": ["SUCCEEDED", "FAILED", "CANCELLED"], "format": "json"}
    ]


# ---- the outbox, on both databases --------------------------------------------------------------------------------
def conf(tmp_path: Path, **kw: Any) -> Settings:
    kw.setdefault("webhook_allow_private", True)  # the receivers are on 127.0.0.1
    return Settings(data_dir=tmp_path, storage_uri=str(tmp_path / "ckpt"), **kw)


def submitted(
    session: Session, settings: Settings | None, notify_entries: list[dict[str, Any]], owner: str = "anonymous"
) -> Job:
    spec = JobSpec.model_validate({**BASE, "notify": notify_entries})
    job, _ = submit(session, spec, caller=Caller(owner=owner), settings=settings)
    session.commit()
    session.refresh(job)  # readable after its session has closed
    return job


def rows(engine: Engine, job_id: str | None = None) -> list[Notification]:
    with Session(engine) as session:
        query = select(Notification).order_by(Notification.id)  # type: ignore[arg-type]
        if job_id:
            query = query.where(Notification.job_id == job_id)
        return list(session.exec(query))


def test_submission_keeps_the_secret_out_of_the_spec_and_queues_matching_events(db: Engine, tmp_path: Path) -> None:
    entries = [{"url": "https://a.example.com/h", "events": ["QUEUED", "FAILED"], "secret": SECRET},
               {"url": "https://b.example.com/h", "format": "slack"}]  # fmt: skip
    with Session(db, expire_on_commit=False) as session:
        job = submitted(session, conf(tmp_path, webhook_secret=CLUSTER_SECRET), entries)
    with Session(db, expire_on_commit=False) as session:
        stored = session.get(Job, job.id)
        assert SECRET not in str(stored.spec)
        assert JobSpec.model_validate(stored.spec).notify[1].format.value == "slack"
        assert [(s.target, s.secret) for s in session.exec(select(NotifySecret))] == [(0, SECRET)]
    (row,) = rows(db, job.id)  # only the entry that asked for QUEUED
    assert (row.target, row.to_state, row.state, row.attempts, row.url) == ("job:0", "QUEUED", "pending", 0,
                                                                            "https://a.example.com/h")  # fmt: skip
    assert row.event_id.startswith("evt_") and f'"id":"{row.event_id}"' in row.body and SECRET not in row.body


def test_state_changes_write_rows_only_for_the_states_asked_and_only_with_the_event(db: Engine) -> None:
    with Session(db, expire_on_commit=False) as session:
        job = Job(name="t", spec={**BASE, "notify": [{"url": "https://a.example.com/", "events": ["SUCCEEDED"]}]})
        session.add(job)
        session.commit()
        transition(session, job, to=S.STARTING, reason="admitted")
        transition(session, job, to=S.RUNNING, reason="first_report")
        session.commit()
        assert rows(db, job.id) == []  # neither state was asked for
        transition(session, job, to=S.SUCCEEDED, reason="succeeded")
        session.rollback()  # the change did not happen: neither did its notification
        assert rows(db, job.id) == []
        session.refresh(job)
        with Session(db, expire_on_commit=False) as other:
            stale = other.get(Job, job.id)  # read while RUNNING by another writer
            other.commit()
            transition(session, job, to=S.SUCCEEDED, reason="succeeded", message="done")
            session.commit()
            with pytest.raises(StaleWrite):  # ... whose write is refused, with no notification
                transition(other, stale, to=S.FAILED, reason="user_error")
            other.rollback()
        job_id = job.id
    (row,) = rows(db, job_id)
    assert (row.to_state, row.target) == ("SUCCEEDED", "job:0")
    doc = __import__("json").loads(row.body)
    assert (doc["from_state"], doc["to_state"], doc["reason"], doc["message"], doc["job"]["state"]) == (
        "RUNNING", "SUCCEEDED", "succeeded", "done", "SUCCEEDED")  # fmt: skip


def test_a_stored_entry_of_another_shape_never_stops_the_job_changing_state(db: Engine) -> None:
    bad = [{"url": "gopher://x"}, "not an entry", {"events": ["FAILED"]}, {"url": "https://ok.example.com/"}]
    with Session(db, expire_on_commit=False) as session:
        job = Job(name="t", spec={**BASE, "notify": bad})
        session.add(job)
        session.commit()
        transition(session, job, to=S.CANCELLED, reason="cancel_requested")
        session.commit()
        assert session.get(Job, job.id).state == S.CANCELLED
    assert [r.target for r in rows(db, job.id)] == ["job:3"]  # the one good entry is still told


def test_cluster_targets_hear_every_job(db: Engine, tmp_path: Path) -> None:
    notify.configure(db, [ClusterWebhook(url="https://ops.example.com/all", events=["QUEUED", "CANCELLED"]),
                          ClusterWebhook(url="https://ops.example.com/end", format="slack")])  # fmt: skip
    try:
        with Session(db, expire_on_commit=False) as session:
            job = submitted(session, None, [{"url": "https://a.example.com/", "events": ["CANCELLED"]}])
            transition(session, job, to=S.CANCELLED, reason="cancel_requested")
            session.commit()
    finally:
        notify.configure(db, [])
    got = [(r.to_state, r.target, r.format) for r in rows(db, job.id)]
    assert got == [("QUEUED", "cluster:0", "json"), ("CANCELLED", "job:0", "json"),
                   ("CANCELLED", "cluster:0", "json"), ("CANCELLED", "cluster:1", "slack")]  # fmt: skip
    by_event = {r.event_id for r in rows(db, job.id) if r.to_state == "CANCELLED"}
    assert len(by_event) == 1  # one change, one id, whichever target hears of it


@pytest.mark.parametrize(
    ("entry", "settings_kw", "field"),
    [
        ({"url": "https://a.example.com/"}, {}, "notify.secret"),  # nothing to sign with
        ({"url": "http://127.0.0.1:8080/", "secret": SECRET}, {"webhook_allow_private": False}, "notify.url"),
        ({"url": "http://[::1]/", "secret": SECRET}, {"webhook_allow_private": False}, "notify.url"),
        ({"url": "http://localhost/", "secret": SECRET}, {"webhook_allow_private": False}, "notify.url"),
        ({"url": "http://169.254.169.254/", "secret": SECRET}, {"webhook_allow_private": False}, "notify.url"),
    ],
)
def test_submission_refuses_what_could_never_be_sent(entry: dict[str, Any], settings_kw: dict[str, Any],
                                                     field: str, tmp_path: Path) -> None:  # fmt: skip
    settings = Settings(data_dir=tmp_path, **settings_kw)
    with pytest.raises(InvalidSpec) as err:
        notify.check_spec(JobSpec.model_validate({**BASE, "notify": [entry]}), settings)
    assert err.value.field == field  # the API's way: no list index in `field`; the message names the entry
    assert err.value.detail.startswith(field.replace("notify.", "notify.0."))


# ---- delivery to a real receiver -----------------------------------------------------------------------------------
@contextmanager
def sending(engine: Engine, settings: Settings) -> Iterator[Sender]:
    sender = Sender(engine=engine, settings=settings)
    stop = threading.Event()
    thread = threading.Thread(target=sender.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield sender
    finally:
        stop.set()
        thread.join(timeout=30)


def fast(tmp_path: Path, **kw: Any) -> Settings:
    base: dict[str, Any] = {"webhook_backoff_seconds": 0.05, "webhook_backoff_max_seconds": 0.2,
                            "webhook_poll_seconds": 0.05, "webhook_timeout_seconds": 2}  # fmt: skip
    return conf(tmp_path, **(base | kw))


def settled(engine: Engine, job_id: str, n: int) -> list[Notification] | None:
    got = rows(engine, job_id)
    return got if len(got) == n and all(r.state != "pending" for r in got) else None


def test_retries_until_the_receiver_takes_it_each_try_signed_with_one_event_id(db: Engine, tmp_path: Path) -> None:
    with running_receiver(refuse_first=2) as rx, Session(db, expire_on_commit=False) as session:
        settings = fast(tmp_path)
        job = submitted(session, settings, [{"url": rx.url("/hook?x=1"), "events": ["QUEUED"], "secret": SECRET}])
        with sending(db, settings):
            (row,) = wait_for(lambda: settled(db, job.id, 1), timeout=30, what="delivered")  # type: ignore[misc]
    assert (row.state, row.attempts, row.last_status, row.last_error) == ("delivered", 3, 204, None)
    assert row.delivered_at is not None
    assert [r.status for r in rx.requests] == [503, 503, 204]
    for got in rx.requests:
        assert got.path == "/hook?x=1" and got.body == row.body.encode()
        assert got.headers["x-shunter-event-id"] == row.event_id
        assert got.headers["host"] == f"127.0.0.1:{rx.port}" and got.headers["content-type"] == "application/json"
        assert verify(SECRET, got.body, got.headers["x-shunter-signature"], now=time.time())
        assert not verify(CLUSTER_SECRET, got.body, got.headers["x-shunter-signature"], now=time.time())
    assert [r.headers["x-shunter-delivery-attempt"] for r in rx.requests] == ["1", "2", "3"]


def test_gives_up_after_max_attempts_with_the_last_error(db: Engine, tmp_path: Path) -> None:
    with running_receiver(refuse_first=100) as rx, Session(db, expire_on_commit=False) as session:
        settings = fast(tmp_path, webhook_max_attempts=3, webhook_secret=CLUSTER_SECRET)
        job = submitted(session, settings, [{"url": rx.url(), "events": ["QUEUED"]}])
        with sending(db, settings):
            (row,) = wait_for(lambda: settled(db, job.id, 1), timeout=30, what="failed")  # type: ignore[misc]
    assert (row.state, row.attempts, row.last_status) == ("failed", 3, 503)
    assert row.last_error.startswith("HTTP 503")
    assert len(rx.requests) == 3
    assert all(verify(CLUSTER_SECRET, r.body, r.headers["x-shunter-signature"], now=time.time()) for r in rx.requests)


def test_a_redirect_is_not_followed(db: Engine, tmp_path: Path) -> None:
    def respond(path: str, n: int) -> tuple[int, dict[str, str]] | None:
        return (302, {"Location": "/elsewhere"}) if path == "/hook" else None

    with running_receiver(respond=respond) as rx, Session(db, expire_on_commit=False) as session:
        settings = fast(tmp_path, webhook_max_attempts=2)
        job = submitted(session, settings, [{"url": rx.url(), "events": ["QUEUED"], "secret": SECRET}])
        with sending(db, settings):
            (row,) = wait_for(lambda: settled(db, job.id, 1), timeout=30, what="failed")  # type: ignore[misc]
    assert (row.state, row.last_status) == ("failed", 302)
    assert "redirect to '/elsewhere' not followed" in row.last_error
    assert {r.path for r in rx.requests} == {"/hook"}


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_loopback_is_refused_at_delivery_without_allow_private(db: Engine, tmp_path: Path, host: str) -> None:
    """A row that names a loopback address (here by writing it past the submission check, as a name resolving there
    would pass it) is refused on the resolved address, never tried again, and the receiver hears nothing."""
    with running_receiver() as rx, Session(db, expire_on_commit=False) as session:
        settings = fast(tmp_path, webhook_allow_private=False)
        job = submitted(session, None, [{"url": rx.url().replace("127.0.0.1", host), "events": ["QUEUED"],
                                         "secret": SECRET}])  # fmt: skip
        with sending(db, settings):
            (row,) = wait_for(lambda: settled(db, job.id, 1), timeout=30, what="refused")  # type: ignore[misc]
    assert (row.state, row.attempts, row.last_status) == ("failed", 1, None)
    assert row.last_error.startswith(f"refused: {host} resolves to an address that is not public")
    assert "127.0.0.1" not in row.last_error.replace(f"refused: {host} ", "")  # what a name resolves to stays inside
    assert rx.requests == []


def test_connects_to_the_address_it_checked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The name is resolved once, by the check; the request goes to that address with the name as Host. httpx could
    not resolve `hooks.rebind.invalid` itself: the request arriving proves it never tried."""
    real = socket.getaddrinfo

    def fake_dns(host: str, *args: Any, **kw: Any) -> Any:
        return real("127.0.0.1", *args, **kw) if host == "hooks.rebind.invalid" else real(host, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", fake_dns)
    assert pinned_address("hooks.rebind.invalid", 80, allow_private=True) == "127.0.0.1"
    with pytest.raises(Exception, match="loopback"):
        pinned_address("hooks.rebind.invalid", 80, allow_private=False)
    import httpx

    from service.workflows.webhooks import post

    with running_receiver() as rx, httpx.Client(trust_env=False, follow_redirects=False, timeout=5) as client:
        result = post(client, f"http://hooks.rebind.invalid:{rx.port}/h", b"{}", {}, allow_private=True)
    assert result.ok, result
    assert rx.requests[0].headers["host"] == f"hooks.rebind.invalid:{rx.port}"


def hang_past_the_timeout(path: str, n: int) -> tuple[int, dict[str, str]] | None:
    time.sleep(3)
    return 204, {}


def test_a_hanging_receiver_does_not_hold_up_another(db: Engine, tmp_path: Path) -> None:
    """A receiver that never answers in time holds at most two of the pool's threads, each for the timeout; another
    job's receiver is served at once."""

    with (
        running_receiver(respond=hang_past_the_timeout) as slow,
        running_receiver() as quick,
        Session(db, expire_on_commit=False) as session,
    ):
        settings = fast(tmp_path, webhook_timeout_seconds=2, webhook_max_attempts=1, webhook_concurrency=4)
        hung = [submitted(session, settings, [{"url": slow.url(), "events": ["QUEUED"], "secret": SECRET}])
                for _ in range(4)]  # fmt: skip
        job = submitted(session, settings, [{"url": quick.url(), "events": ["QUEUED"], "secret": SECRET}])
        with sending(db, settings):
            wait_for(lambda: settled(db, job.id, 1), timeout=30, what="the quick receiver's delivery", interval=0.05)
            wait_for(lambda: all(settled(db, h.id, 1) for h in hung), timeout=60, what="the slow ones to time out")
    # Delivered before any try of the hanging receiver had timed out: it came in less than the timeout (2 s) after
    # the first of them did (the receivers' own clocks, not the test's: a loaded machine starts the sender late).
    assert quick.arrivals and quick.arrivals[0] < min(slow.arrivals) + 2.0, (quick.arrivals, slow.arrivals)
    assert rows(db, job.id)[0].state == "delivered"
    assert all(r.state == "failed" and "Timeout" in (r.last_error or "") for h in hung for r in rows(db, h.id))
    # Two tries at a time (PER_URL_IN_FLIGHT), though the pool had room for four: a third begins only when one of the
    # first two has timed out (the server's handlers sleep on after the sender gave up, so count arrivals).
    arrivals = sorted(slow.arrivals)
    assert len(arrivals) == 4 and arrivals[2] - arrivals[0] > 1.8 and arrivals[3] - arrivals[1] > 1.8, arrivals


def test_one_owners_many_slow_receivers_do_not_hold_up_another_owner(db: Engine, tmp_path: Path) -> None:
    """A tenant chooses its URLs: six jobs of mallory's, each with a receiver of its own (distinct URLs, so the
    per-URL limit never bites) that hangs past the timeout, submitted first. They hold at most three of the pool's
    four threads (`owner_in_flight`), so alice's delivery, due after all of them, goes out at once."""

    with (
        running_receiver(respond=hang_past_the_timeout) as slow,
        running_receiver() as quick,
        Session(db, expire_on_commit=False) as session,
    ):
        settings = fast(tmp_path, webhook_timeout_seconds=2, webhook_max_attempts=1, webhook_concurrency=4)
        hung = [submitted(session, settings, [{"url": slow.url(f"/h{i}"), "events": ["QUEUED"], "secret": SECRET}],
                          owner="mallory") for i in range(6)]  # fmt: skip
        job = submitted(session, settings, [{"url": quick.url(), "events": ["QUEUED"], "secret": SECRET}],
                        owner="alice")  # fmt: skip
        with sending(db, settings):
            wait_for(lambda: settled(db, job.id, 1), timeout=30, what="alice's delivery", interval=0.05)
            wait_for(lambda: all(settled(db, h.id, 1) for h in hung), timeout=60, what="mallory's to time out")
    # Before any of mallory's tries had timed out (2 s after the first of them came in; the receivers' clocks).
    assert quick.arrivals and quick.arrivals[0] < min(slow.arrivals) + 2.0, (quick.arrivals, slow.arrivals)
    assert rows(db, job.id)[0].state == "delivered"
    assert owner_in_flight(4) == 3 and owner_in_flight(8) == 4 and owner_in_flight(1) == 3
    arrivals = sorted(slow.arrivals)  # three of mallory's at a time: the fourth only once one of them timed out
    assert len(arrivals) == 6 and arrivals[3] - arrivals[0] > 1.8, arrivals


def test_two_senders_never_claim_one_row(db: Engine, tmp_path: Path) -> None:
    with Session(db, expire_on_commit=False) as session:
        settings = fast(tmp_path)
        jobs_ = [submitted(session, settings, [{"url": "https://a.example.com/", "events": ["QUEUED"],
                                                "secret": SECRET}]) for _ in range(20)]  # fmt: skip
    assert len(jobs_) == 20
    one, two = Sender(engine=db, settings=settings), Sender(engine=db, settings=settings)
    got: list[list[int]] = [[], []]

    def claim(sender: Sender, out: list[int]) -> None:
        for _ in range(5):
            out.extend(r.id for r, _ in sender.claim(limit=3))  # type: ignore[misc]

    threads = [threading.Thread(target=claim, args=(s, o)) for s, o in ((one, got[0]), (two, got[1]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not set(got[0]) & set(got[1])
    assert len(got[0]) + len(got[1]) == len(set(got[0]) | set(got[1]))


# ---- the API -------------------------------------------------------------------------------------------------------
TOKENS = {"tok-alice": {"owner": "alice"}, "tok-bob": {"owner": "bob"}, "tok-admin": {"owner": "root", "admin": True}}


@pytest.fixture
def api(tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'api.db'}", ray_address="127.0.0.1:9", ray_dashboard_url="http://127.0.0.1:9",
        api_tokens=TOKENS, webhook_secret=CLUSTER_SECRET,
        webhooks=[ClusterWebhook(url="https://hooks.slack.example.com/services/T0/B0/XYZ", events=["QUEUED"],
                                 format="slack")],
    )  # fmt: skip
    runtime = Runtime.open(settings)
    with TestClient(create_app(runtime=runtime), raise_server_exceptions=False) as client:
        yield client
    runtime.close()


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_api_shows_deliveries_to_the_owner_never_the_secret(api: TestClient) -> None:
    body = {**BASE, "notify": [{"url": "https://hooks.example.com/h", "events": ["QUEUED"], "secret": SECRET}]}
    created = api.post("/v1/jobs", json=body, headers=auth("tok-alice"))
    assert created.status_code == 201, created.text
    assert SECRET not in created.text
    job_id = created.json()["id"]
    shown = api.get(f"/v1/jobs/{job_id}", headers=auth("tok-alice"))
    assert SECRET not in shown.text and shown.json()["spec"]["notify"][0]["url"] == "https://hooks.example.com/h"
    mine = api.get(f"/v1/jobs/{job_id}/notifications", headers=auth("tok-alice"))
    assert mine.status_code == 200 and SECRET not in mine.text
    got = [(n["target"], n["url"], n["state"], n["attempts"], n["to_state"]) for n in mine.json()]
    assert got == [("job:0", "https://hooks.example.com/h", "pending", 0, "QUEUED"),
                   ("cluster:0", "https://hooks.slack.example.com/...", "pending", 0, "QUEUED")]  # fmt: skip
    admin = api.get(f"/v1/jobs/{job_id}/notifications", headers=auth("tok-admin")).json()
    assert admin[1]["url"] == "https://hooks.slack.example.com/services/T0/B0/XYZ"
    assert api.get(f"/v1/jobs/{job_id}/notifications", headers=auth("tok-bob")).status_code == 404


@pytest.mark.parametrize(
    ("entry", "field"),
    [
        ({"url": "gopher://example.com/"}, "notify.url"),
        ({"url": "http://10.0.0.5/hook"}, "notify.url"),
        ({"url": "https://example.com/", "events": ["SUCCEDED"]}, "notify.events"),
        ({"url": "https://example.com/", "secret": "x"}, "notify.secret"),
    ],
)
def test_api_refuses_bad_entries_with_422(api: TestClient, entry: dict[str, Any], field: str) -> None:
    answer = api.post("/v1/jobs", json={**BASE, "notify": [entry]}, headers=auth("tok-alice"))
    assert answer.status_code == 422, answer.text
    assert answer.json()["field"] == field


@pytest.mark.parametrize("value", ["", "   "])
def test_an_empty_cluster_secret_in_the_environment_is_unset_not_a_start_up_error(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHUNTER_WEBHOOK_SECRET", value)
    assert Settings().webhook_secret is None
    monkeypatch.setenv("SHUNTER_WEBHOOK_SECRET", "short")
    with pytest.raises(ValueError, match="webhook_secret"):
        Settings()


@pytest.mark.parametrize("drip", [False, True], ids=["endless", "dripped"])
def test_a_refusing_receivers_answer_is_read_only_in_part(drip: bool) -> None:
    """The answer is the tenant's to write: an endless one (it would fill the service's memory) or one dripped a byte
    at a time (it would hold a sending thread) is cut at BODY_KEPT bytes or BODY_SECONDS, whichever comes first."""
    import httpx

    from service.workflows.webhooks import BODY_KEPT, BODY_SECONDS, post

    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 100000000000\r\n\r\n")
            try:
                while not stop.is_set():
                    conn.sendall(b"x" if drip else b"x" * 65536)
                    if drip:
                        time.sleep(0.2)
            except OSError:
                pass  # the sender hung up: what this test wants

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    port = listener.getsockname()[1]
    try:
        with httpx.Client(trust_env=False, follow_redirects=False, timeout=5) as client:
            started = time.monotonic()
            result = post(client, f"http://127.0.0.1:{port}/h", b"{}", {}, allow_private=True)
            took = time.monotonic() - started
    finally:
        stop.set()
        listener.close()
    assert not result.ok and result.status == 500
    assert result.error is not None and result.error.startswith("HTTP 500: x")
    assert len(result.error) <= len("HTTP 500: ") + BODY_KEPT
    assert took < BODY_SECONDS + 2, took
