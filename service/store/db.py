"""Engine and sessions. SQLite (a real file, WAL) for one machine; PostgreSQL for many processes."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DataError, DisconnectionError, IntegrityError
from sqlmodel import Session, create_engine

from service.store import notify_tables  # noqa: F401  (registers the tables on SQLModel.metadata)


def make_engine(url: str, **kwargs: Any) -> Engine:
    """An engine with the settings each backend needs to be safe under several processes."""
    if url.startswith("sqlite"):
        connect_args = {"check_same_thread": False, "timeout": 30}
        engine = create_engine(url, connect_args=connect_args, **kwargs)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            # WAL lets readers run beside the writer; busy_timeout makes writers queue instead of failing.
            # isolation_level=None hands transaction control to the BEGIN below.
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        turns = WriteTurns()

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn: Any) -> None:
            # Write transactions take the write lock at BEGIN (IMMEDIATE): a read-then-write can then never fail
            # halfway on lock upgrade, which is what makes guarded updates safe across processes. Reads stay
            # deferred, so WAL readers never block the writer.
            immediate = conn.get_execution_options().get(WRITE_OPTION)
            if immediate:
                turns.take(conn.connection.record_info)
            conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

        @event.listens_for(engine, "checkin")
        def _sqlite_checkin(_dbapi_conn: Any, record: Any) -> None:
            turns.give_back(record.record_info)  # the transaction is over (committed, rolled back, or the conn lost)

        return engine
    # A pool that keeps what a busy API uses: with SQLAlchemy's default (5 kept, 10 more opened and closed again),
    # 16 concurrent submissions opened and closed a connection (a PostgreSQL backend process) every few requests.
    kwargs.setdefault("pool_size", POOL_SIZE)
    kwargs.setdefault("max_overflow", POOL_OVERFLOW)
    engine = create_engine(url, **kwargs)
    _ping_when_idle(engine)
    if engine.dialect.name == "postgresql":
        event.listen(engine, "before_cursor_execute", _no_nul_in_text, retval=True)
    return engine


POOL_SIZE, POOL_OVERFLOW = 15, 5  # connections kept open; opened beyond them at a peak, and closed after
PING_AFTER_IDLE_SECONDS = 2.0  # a pooled connection unused this long is pinged before it is handed out


def _ping_when_idle(engine: Engine) -> None:
    """SQLAlchemy's `pool_pre_ping`, for connections that sat in the pool: one handed back moments ago was alive then,
    and pinging it again was a round trip of a PostgreSQL submission's six. A connection that has been idle (the
    server restarted meanwhile, or closed it on an idle timeout) is still pinged, and a dead one replaced before any
    request sees it; one that dies while in use fails its request (a 503 the client retries) and the pool starts
    afresh, as SQLAlchemy does on any disconnect."""

    @event.listens_for(engine, "connect")
    def _connected(_dbapi_conn: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkin")
    def _checked_in(_dbapi_conn: Any, record: Any) -> None:
        if record is not None:
            record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checked_out(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        since = record.info.get("idle_since")
        if since is not None and time.monotonic() - since < PING_AFTER_IDLE_SECONDS:
            return
        try:
            engine.dialect.do_ping(dbapi_conn)
        except Exception as exc:  # noqa: BLE001 - whatever the driver raised: the pool connects again
            raise DisconnectionError(f"pooled connection failed its ping: {exc}") from exc


# The database refuses one job's values (a value of an enum it lacks, a constraint): the same write fails on every
# try, so the job is at fault, not the database. Every other database error (away, restarting, out of connections,
# a schema of another release during a rolling upgrade) is nobody's job's fault: retried later.
JOB_DATA_ERRORS: tuple[type[Exception], ...] = (DataError, IntegrityError)


def _no_nul_in_text(_conn: Any, _cursor: Any, statement: str, parameters: Any, _context: Any, _many: bool) -> Any:
    """PostgreSQL text cannot hold a NUL character, and text from outside (a Ray Job's message and log tail, a
    driver's report) may carry one: a job printing one must not make its own end unwritable. Each NUL in a bound
    string becomes U+FFFD. (JSON values are bound by psycopg as JSON, where a NUL is the escape `\\u0000`: the `json`
    columns store that as is; a `jsonb` column would refuse it.)"""
    return statement, _scrub(parameters)


def _scrub(value: Any) -> Any:
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd") if "\x00" in value else value
    if isinstance(value, dict):
        return {k: _scrub(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_scrub(v) for v in value)
    return value


log = logging.getLogger(__name__)

WRITE_OPTION = "shunter_write"
TURN_WAIT_SECONDS = 10.0


class WriteTurns:
    """This process's SQLite writers, one at a time. SQLite has one writer per database, and a writer that finds the
    lock taken retries in its busy handler with sleeps growing to 100 ms: under 16 concurrent submissions the p99
    was a second and more while the lock sat free between sleeps. Writers of one process queue here instead and are
    handed the turn the moment the last one's connection goes back to the pool (after its COMMIT or ROLLBACK). Other
    processes still meet SQLite's own lock and busy timeout. A turn awaited longer than `TURN_WAIT_SECONDS` (a
    writer nested in another on one thread) is not waited for further: SQLite's lock decides, as it did before."""

    KEY = "shunter_write_turn"

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def take(self, record_info: dict[str, Any]) -> None:
        if record_info.get(self.KEY) is None:
            took = record_info[self.KEY] = self._lock.acquire(timeout=TURN_WAIT_SECONDS)
            if not took:  # every such write has cost TURN_WAIT_SECONDS: a nesting to find and undo
                log.warning("a SQLite write waited %.0f s for its turn and went on without it (a write transaction "
                            "begun inside another on one thread?)", TURN_WAIT_SECONDS, stack_info=True)  # fmt: skip

    def give_back(self, record_info: dict[str, Any] | None) -> None:
        if record_info is not None and record_info.pop(self.KEY, None):
            self._lock.release()


@contextmanager
def session_scope(engine: Engine, *, write: bool = True) -> Iterator[Session]:
    """One transaction (a write one unless `write=False`): commit on success, roll back on error."""
    with Session(engine, expire_on_commit=False) as session:
        if write:
            begin_write(session)
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise


_write_binds: weakref.WeakKeyDictionary[Engine, Engine] = weakref.WeakKeyDictionary()


def write_bind(engine: Engine) -> Engine:
    """`engine` for sessions whose transactions are write ones from their first statement (BEGIN IMMEDIATE on
    SQLite), begun lazily, like any session's, in the thread that first uses it; the same pool."""
    bound = _write_binds.get(engine)
    if bound is None or bound.pool is not engine.pool:  # (a disposed engine has a new pool)
        bound = _write_binds[engine] = engine.execution_options(**{WRITE_OPTION: True})
        _bases[bound] = engine
    return bound


_bases: weakref.WeakKeyDictionary[Engine, Engine] = weakref.WeakKeyDictionary()


def base_engine(bind: Any) -> Engine:
    """The engine a session's bind stands for: a Connection's engine, `write_bind`'s own engine. What is kept per
    engine (webhook targets, key caches) is kept under this one."""
    engine = bind.engine if isinstance(bind, Connection) else bind
    return _bases.get(engine, engine)


def begin_write(session: Session) -> None:
    """Mark the session's transaction as a write one (BEGIN IMMEDIATE on SQLite; no-op elsewhere)."""
    session.connection(execution_options={WRITE_OPTION: True})


def reachable(url: str) -> bool:
    """Whether a database at `url` answers a query (for tests, benchmarks and readiness-like checks)."""
    try:
        engine = make_engine(url, isolation_level="AUTOCOMMIT") if url.startswith("postgresql") else make_engine(url)
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
        engine.dispose()
        return True
    except Exception:  # noqa: BLE001 - any failure means not reachable
        return False
