"""Wake-ups: who should look again now, rather than at its next tick or poll.

A writer says what it changed with `publish(session, channel, payload)`; nothing is sent unless that transaction
commits. Subscribers in this process hear it right after the commit; on PostgreSQL every other process does too,
through `NOTIFY` (sent in the same transaction, so PostgreSQL delivers it at commit and drops it on a rollback), which
one listening connection per process (`Hub`) fans out to its subscribers. A signal is only ever a hint to look again:
polling stays as the fallback, so a lost one (a listener reconnecting, a process on another SQLite host) costs
latency, never correctness.

Channels:
- `admission`: something that can free room or needs it: a job posted, an attempt's driver said it ended, a cancel,
  a queue's limits changed. Payload: the job's id, or "" (the dispatcher holding that job reconciles it at once).
- `events`: job events were written. Payload: the job's id (the event streams of that job read the new rows).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import event, text
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session as OrmSession
from sqlmodel import Session

log = logging.getLogger(__name__)

ADMISSION = "admission"
EVENTS = "events"
CHANNELS = (ADMISSION, EVENTS)
PG_PREFIX = "shunter_"  # PostgreSQL channel names: shunter_admission, shunter_events
MAX_PAYLOAD = 7000  # PostgreSQL refuses a NOTIFY payload of 8000 bytes or more: longer batches are split
_PENDING = "shunter_signals"
_SENT = "shunter_signals_sent"  # of those, the ones a statement already carried (unsent_notes)

Callback = Callable[[str], None]


def publish(session: Session, channel: str, payload: str = "") -> None:
    """Say `payload` on `channel` once `session`'s transaction commits (nothing on a rollback). Repeats within one
    transaction are sent once."""
    session.info.setdefault(_PENDING, {}).setdefault(channel, set()).add(payload)


def unsent_notes(session: Session) -> list[tuple[str, str]]:
    """(channel, payload) of each NOTIFY for what `session` has published and not yet sent, which from now on counts
    as sent: for a statement that carries its `pg_notify` calls itself (service.lifecycle.jobs writes a submission's
    job, event and signals in one). They are still heard in this process once the transaction commits. Empty when there
    is nothing to send, or the database is not PostgreSQL."""
    pending = session.info.get(_PENDING)
    if not pending or session.get_bind().dialect.name != "postgresql":
        return []
    sent = session.info.setdefault(_SENT, {})
    # A NOTIFY per channel and 7000 bytes of payloads, which the listener splits again.
    notes: list[tuple[str, str]] = []
    for channel, payloads in sorted(pending.items()):
        fresh = sorted(set(payloads) - sent.get(channel, set()))
        if fresh:
            notes += [(PG_PREFIX + channel, batch) for batch in _batches(fresh)]
            sent.setdefault(channel, set()).update(fresh)
    return notes


@event.listens_for(OrmSession, "before_commit")
def _before_commit(session: OrmSession) -> None:
    notes = unsent_notes(session)  # type: ignore[arg-type]  # the ORM's Session, of which SQLModel's is a subclass
    if not notes:
        return
    # One statement for all (a round trip of a submission's few).
    calls = ", ".join(f"pg_notify(:c{i}, :p{i})" for i in range(len(notes)))
    params = {k: v for i, (channel, batch) in enumerate(notes) for k, v in ((f"c{i}", channel), (f"p{i}", batch))}
    session.execute(text(f"SELECT {calls}"), params)


def _batches(payloads: list[str]) -> list[str]:
    out, current = [], ""
    for payload in payloads:
        if current and len(current) + len(payload) + 1 > MAX_PAYLOAD:
            out.append(current)
            current = ""
        current = f"{current},{payload}" if current else payload
    return [*out, current]


@event.listens_for(OrmSession, "after_commit")
def _after_commit(session: OrmSession) -> None:
    session.info.pop(_SENT, None)
    pending = session.info.pop(_PENDING, None)
    if pending:
        hub_for(session.get_bind()).fire_local(pending)


@event.listens_for(OrmSession, "after_rollback")
def _after_rollback(session: OrmSession) -> None:
    session.info.pop(_PENDING, None)
    session.info.pop(_SENT, None)


class Hub:
    """This process's subscribers, per channel; on PostgreSQL also its one listening connection (a daemon thread,
    started by the first subscriber, reconnecting with backoff while the database is away)."""

    def __init__(self, engine: Engine) -> None:
        self.url = engine.url
        self.postgres = engine.dialect.name == "postgresql"
        self._lock = threading.Lock()
        self._subscribers: dict[str, list[Callback]] = {}
        self._thread: threading.Thread | None = None
        self.listening = threading.Event()  # set while the PostgreSQL listener is connected
        self._closed = False

    @property
    def cross_process(self) -> bool:
        """Whether signals from other processes arrive now (a PostgreSQL listener is connected)."""
        return self.postgres and self.listening.is_set()

    def subscribe(self, channel: str, callback: Callback) -> Callable[[], None]:
        """Call `callback(payload)` for every payload said on `channel` (from this hub's thread, or the committing
        one: keep it short); returns the unsubscribe call."""
        with self._lock:
            self._subscribers.setdefault(channel, []).append(callback)
            if self.postgres and self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._listen, name="signals", daemon=True)
                self._thread.start()

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._subscribers.get(channel, []):
                    self._subscribers[channel].remove(callback)

        return unsubscribe

    def fire_local(self, pending: dict[str, set[str]]) -> None:
        """Deliver a committed transaction's signals here. On PostgreSQL the listener delivers them (ours included),
        unless it is not connected now."""
        if self.cross_process:
            return
        for channel, payloads in pending.items():
            self._deliver(channel, payloads)

    def _deliver(self, channel: str, payloads: set[str] | list[str]) -> None:
        with self._lock:
            callbacks = list(self._subscribers.get(channel, ()))
        for callback in callbacks:
            for payload in payloads:
                try:
                    callback(payload)
                except Exception:  # noqa: BLE001 - one subscriber's fault must not silence the others
                    log.exception("signal subscriber failed on %s", channel)

    def _listen(self) -> None:
        import psycopg

        dsn = self.url.set(drivername="postgresql").render_as_string(hide_password=False)
        delay = 0.5
        while self._wanted():
            try:
                with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
                    for channel in CHANNELS:
                        conn.execute(f"LISTEN {PG_PREFIX}{channel}")
                    self.listening.set()
                    delay = 0.5
                    # Anything said while the listener was away is only caught by polling: wake everyone once.
                    for channel in CHANNELS:
                        self._deliver(channel, [""])
                    while self._wanted():
                        for note in conn.notifies(timeout=1.0):
                            channel = note.channel.removeprefix(PG_PREFIX)
                            self._deliver(channel, note.payload.split(",") if note.payload else [""])
            except Exception as exc:  # noqa: BLE001 - the database away: pollers carry on; try again
                log.warning("signal listener lost its connection: %s", exc)
            finally:
                self.listening.clear()
            time.sleep(delay)
            delay = min(delay * 2, 10.0)

    def _wanted(self) -> bool:
        """Whether the listener should go on; once nobody listens it ends (the next subscriber starts another)."""
        with self._lock:
            if not self._closed and any(self._subscribers.values()):
                return True
            self._thread = None
            return False

    def close(self) -> None:
        self._closed = True


_hubs: dict[str, Hub] = {}
_hubs_lock = threading.Lock()


def hub_for(engine: Any) -> Hub:
    """The hub of `engine`'s database in this process (one per database URL, shared by every engine on it)."""
    key = engine.url.render_as_string(hide_password=False)
    with _hubs_lock:
        hub = _hubs.get(key)
        if hub is None:
            hub = _hubs[key] = Hub(engine)
        return hub


class Waker:
    """A `threading.Event` set by signals on one channel, with the payloads heard since the last `take`."""

    def __init__(self, engine: Engine, channel: str = ADMISSION) -> None:
        self.event = threading.Event()
        self._lock = threading.Lock()
        self._heard: set[str] = set()
        self._unsubscribe = hub_for(engine).subscribe(channel, self._on)

    def _on(self, payload: str) -> None:
        with self._lock:
            if payload:
                self._heard.add(payload)
        self.event.set()

    def wait(self, timeout: float) -> bool:
        return self.event.wait(timeout)

    def take(self) -> set[str]:
        """The payloads heard since the last call (and clear the event)."""
        with self._lock:
            self.event.clear()
            heard, self._heard = self._heard, set()
        return heard

    def close(self) -> None:
        self._unsubscribe()
        self.event.set()
