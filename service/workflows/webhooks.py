"""Webhook delivery: the sender thread that empties the notifications outbox (`service.workflows.notifications` fills
it).

Each pass claims due rows (a guarded UPDATE that stamps a claim token and moves `next_at` past the longest a send
may take, after `FOR UPDATE SKIP LOCKED` on PostgreSQL, so several processes never send one row at the same moment),
sends them on a small pool, and writes each result back fenced by its token. A sender killed mid-send leaves the
claim to lapse and the row is sent again: delivery is at least once, and receivers de-duplicate on the event id.

Each try resolves the URL's host, refuses it if any address it resolves to is not public (unless
`webhook_allow_private`), and connects to the address it checked (the URL's host stays in the Host header and in
TLS's SNI and certificate check), so a name that changes its answer between check and connect gets nowhere. No
redirect is followed; anything but a 2xx is a failed try. A slow receiver holds at most `PER_URL_IN_FLIGHT` of the
pool's threads, each for at most the timeout; and the `notify` targets of one owner's jobs (URLs that are theirs to
choose: a thousand slow receivers of one tenant) hold at most `owner_in_flight` of them, about half the pool, so they
cannot hold up other owners' deliveries nor the cluster's own targets. Each pass reads at most `PER_URL_IN_FLIGHT`
due rows per URL, so no backlog to one URL hides the rows behind it.
"""

from __future__ import annotations

import logging
import random
import socket
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlsplit, urlunsplit

import httpx
from sqlalchemy import func, update
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from service.config.settings import Settings
from service.policy.webhook_rules import (
    EVENT_ID_HEADER,
    SIGNATURE_HEADER,
    RetryPolicy,
    address_problem,
    after_attempt,
    sign,
)
from service.store.db import session_scope
from service.store.models import Job, utcnow
from service.store.notify_tables import DELIVERED, FAILED, PENDING, Notification
from service.workflows import notifications as notify

log = logging.getLogger(__name__)
PER_URL_IN_FLIGHT = 2
IDLE_POLLS = 4  # an idle outbox is looked at every 4 polls at most (Sender.run)


def owner_in_flight(concurrency: int) -> int:
    """How many of the pool's sends one owner's own targets may hold: half the pool, and more than one URL's share."""
    return max(PER_URL_IN_FLIGHT + 1, concurrency // 2)


USER_AGENT = "shunter-webhooks/1"


class Refused(Exception):
    """A try that must not be repeated: the host resolves to an address webhooks may not reach."""


@dataclass(frozen=True)
class Result:
    ok: bool
    status: int | None = None
    error: str | None = None
    permanent: bool = False


def pinned_address(host: str, port: int, *, allow_private: bool) -> str:
    """The address to connect to: every address `host` resolves to must be public (unless `allow_private`)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise OSError(f"cannot resolve {host!r}: {exc}") from None
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    if not addresses:
        raise OSError(f"{host!r} resolves to no address")
    if not allow_private:
        for address in addresses:
            problem = address_problem(address)
            if problem:
                # The owner reads the error on the notification: it says no more than that the name is refused.
                # The address it resolved to (an internal machine's) is for the operator's log only (issue 35).
                log.warning("webhook refused: %s resolves to %s", host, problem)
                raise Refused(f"refused: {host} resolves to an address that is not public (loopback, private, "
                              f"link-local or reserved); webhooks are sent to public addresses only")  # fmt: skip
    return addresses[0]


def post(client: httpx.Client, url: str, body: bytes, headers: dict[str, str], *, allow_private: bool) -> Result:
    """One try of one delivery, to the checked address of the URL's host."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        address = pinned_address(host, port, allow_private=allow_private)
    except Refused as exc:
        return Result(ok=False, error=str(exc), permanent=True)
    except OSError as exc:
        return Result(ok=False, error=str(exc))
    netloc = f"[{address}]" if ":" in address else address
    pinned = urlunsplit((parts.scheme, f"{netloc}:{port}", parts.path or "/", parts.query, ""))
    host_header = parts.netloc.rpartition("@")[2]
    # Streamed: the receiver's answer is the tenant's to write, so no more than BODY_KEPT bytes of it are read (a
    # gigabyte answer must not fill the service's memory), and none after BODY_SECONDS (nor one dripped a byte at a
    # time to hold a sending thread).
    try:
        with client.stream("POST", pinned, content=body, headers={**headers, "Host": host_header},
                           extensions={"sni_hostname": host}) as response:  # fmt: skip
            if 200 <= response.status_code < 300:
                return Result(ok=True, status=response.status_code)
            if response.is_redirect:
                where = response.headers.get("location", "")[:200]
                return Result(ok=False, status=response.status_code, error=f"redirect to {where!r} not followed")
            said = _head_of(response)
    except httpx.HTTPError as exc:
        return Result(ok=False, error=f"{type(exc).__name__}: {exc}"[:500])
    return Result(ok=False, status=response.status_code, error=f"HTTP {response.status_code}: {said}")


BODY_KEPT = 200  # bytes of a refusing receiver's answer kept as the row's last_error
BODY_SECONDS = 2.0


def _head_of(response: httpx.Response) -> str:
    kept, deadline = b"", time.monotonic() + BODY_SECONDS
    for chunk in response.iter_raw():  # as it arrives (a chunk size would wait to fill it)
        kept += chunk
        if len(kept) >= BODY_KEPT or time.monotonic() > deadline:
            break
    return kept[:BODY_KEPT].decode("utf-8", "replace")


class Sender:
    """Sends the outbox; `run(stop)` in a thread of its own, beside the dispatcher (`service.runtime`)."""

    def __init__(self, *, engine: Engine, settings: Settings) -> None:
        self.engine = engine
        self.settings = settings
        self.policy = RetryPolicy(max_attempts=settings.webhook_max_attempts,
                                  base_seconds=settings.webhook_backoff_seconds,
                                  cap_seconds=settings.webhook_backoff_max_seconds)  # fmt: skip
        # A claim outlives the longest a try may take (resolve, connect, write, read) with room to spare.
        self.claim_seconds = 4 * settings.webhook_timeout_seconds + 5
        self._pool = ThreadPoolExecutor(max_workers=settings.webhook_concurrency, thread_name_prefix="webhook")
        self._in_flight: dict[int, tuple[str, str, Future[None]]] = {}  # row id -> (url, owner, its send)
        self._client = httpx.Client(timeout=settings.webhook_timeout_seconds, follow_redirects=False, trust_env=False,
                                    headers={"User-Agent": USER_AGENT})  # fmt: skip

    def run(self, stop: threading.Event) -> None:
        """A pass every `webhook_poll_seconds` while there is something to send; after a pass that found nothing,
        the wait doubles up to IDLE_POLLS times that (an idle service polled its empty outbox twice a second)."""
        wait = self.settings.webhook_poll_seconds
        try:
            while not stop.is_set():
                try:
                    busy = self.pass_once() > 0 or bool(self._in_flight)
                except Exception:  # noqa: BLE001 - no database for a moment: the next pass tries again
                    log.exception("webhook pass failed")
                    busy = False
                poll = self.settings.webhook_poll_seconds
                wait = poll if busy else min(2 * wait, IDLE_POLLS * poll)
                stop.wait(wait)
        finally:
            self._pool.shutdown(wait=True)
            self._client.close()

    def pass_once(self) -> int:
        """Claim what is due and free to send, and hand it to the pool; returns how many were claimed."""
        self._in_flight = {i: (u, o, f) for i, (u, o, f) in self._in_flight.items() if not f.done()}
        free = self.settings.webhook_concurrency - len(self._in_flight)
        if free <= 0:
            return 0
        claimed = self.claim(limit=free)
        for row, owner in claimed:
            assert row.id is not None
            self._in_flight[row.id] = (row.url, owner, self._pool.submit(self.deliver, row))
        return len(claimed)

    def claim(self, *, limit: int) -> list[tuple[Notification, str]]:
        """Due pending rows, with their job's owner, at most `PER_URL_IN_FLIGHT` per URL and (for the jobs' own targets)
        `owner_in_flight` per owner, counting those in flight, claimed for this sender."""
        now = utcnow()
        per_url: dict[str, int] = {}
        per_owner: dict[str, int] = {}
        for url, owner, _ in self._in_flight.values():
            per_url[url] = per_url.get(url, 0) + 1
            per_owner[owner] = per_owner.get(owner, 0) + 1
        owner_cap = owner_in_flight(self.settings.webhook_concurrency)
        due = (Notification.state == PENDING, col(Notification.next_at) <= now)
        with session_scope(self.engine, write=False) as session:  # most passes find nothing: no write lock for that
            if session.exec(select(Notification.id).where(*due).limit(1)).first() is None:
                return []
        with session_scope(self.engine) as session:
            # Each URL's first due rows only (a window, so a backlog to one URL never fills the read), then those rows
            # locked (PostgreSQL allows no FOR UPDATE beside a window function). An owner's own targets are "job:<i>";
            # the cluster's ("cluster:<i>") count against no owner.
            order = (col(Notification.next_at), col(Notification.id))
            ranked = (
                select(
                    col(Notification.id).label("id"),
                    col(Job.owner).label("owner"),
                    func.row_number().over(partition_by=col(Notification.url), order_by=order).label("n"),
                )  # fmt: skip
                .join(Job, col(Job.id) == col(Notification.job_id))
                .where(*due)
                .subquery()
            )
            firsts = select(ranked.c.id, ranked.c.owner).where(ranked.c.n <= PER_URL_IN_FLIGHT)
            owner_of = dict(session.execute(firsts).tuples().all())
            if not owner_of:
                return []
            query = select(Notification).where(col(Notification.id).in_(list(owner_of)), *due).order_by(*order)
            if session.get_bind().dialect.name == "postgresql":
                query = query.with_for_update(skip_locked=True)
            chosen: list[tuple[Notification, str]] = []
            for row in session.exec(query).all():
                owner = owner_of[row.id] if row.target.startswith("job:") else ""  # "": the cluster's own
                if (len(chosen) >= limit or per_url.get(row.url, 0) >= PER_URL_IN_FLIGHT
                        or (owner and per_owner.get(owner, 0) >= owner_cap)):  # fmt: skip
                    continue
                token = uuid.uuid4().hex
                result = session.execute(
                    update(Notification)
                    .where(
                        col(Notification.id) == row.id,
                        col(Notification.state) == PENDING,
                        col(Notification.next_at) <= now,
                    )  # fmt: skip
                    .values(claim_token=token, next_at=now + timedelta(seconds=self.claim_seconds))
                    .execution_options(synchronize_session=False)
                )
                if result.rowcount == 1:  # type: ignore[attr-defined]  # an UPDATE's result is a CursorResult; Session.execute says Result
                    row.claim_token = token
                    per_url[row.url] = per_url.get(row.url, 0) + 1
                    per_owner[owner] = per_owner.get(owner, 0) + 1
                    chosen.append((row, owner))
            for row, _ in chosen:
                session.expunge(row)
        return chosen

    def deliver(self, row: Notification) -> None:
        """One try of a claimed row, and its result written back (only if the claim is still this sender's)."""
        try:
            with Session(self.engine) as session:
                secret = notify.secret_for(session, row, self.settings)
            if secret is None:
                result = Result(ok=False, error="no secret to sign with (SHUNTER_WEBHOOK_SECRET unset)", permanent=True)
            else:
                body = row.body.encode()
                headers = {"Content-Type": "application/json", EVENT_ID_HEADER: row.event_id,
                           SIGNATURE_HEADER: sign(secret, body, timestamp=int(time.time())),
                           "X-Shunter-Delivery-Attempt": str(row.attempts + 1)}  # fmt: skip
                result = post(self._client, row.url, body, headers, allow_private=self.settings.webhook_allow_private)
            self.record(row, result)
        except Exception:  # noqa: BLE001 - the claim lapses and the row is tried again
            log.exception("webhook delivery %s failed unexpectedly", row.id)

    def record(self, row: Notification, result: Result) -> None:
        attempts = row.attempts + 1
        outcome = after_attempt(attempts=attempts, ok=result.ok, permanent=result.permanent, policy=self.policy,
                                jitter=random.random())  # fmt: skip
        now = utcnow()
        values: dict[str, object] = {"state": outcome.state, "attempts": attempts, "claim_token": None,
                                     "last_status": result.status, "last_error": result.error}  # fmt: skip
        if outcome.state == DELIVERED:
            values["delivered_at"] = now
        elif outcome.state == PENDING:
            values["next_at"] = now + timedelta(seconds=outcome.retry_in or 0.0)
        if outcome.state == FAILED:
            log.warning("webhook %s (%s, event %s) failed after %d tries: %s", row.id, row.target, row.event_id,
                        attempts, result.error)  # fmt: skip
        with session_scope(self.engine) as session:
            session.execute(
                update(Notification)
                .where(col(Notification.id) == row.id, col(Notification.claim_token) == row.claim_token)
                .values(**values)
                .execution_options(synchronize_session=False)
            )
