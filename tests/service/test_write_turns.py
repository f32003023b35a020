"""SQLite writers of one process take turns (service.store.db.WriteTurns) instead of polling SQLite's lock with sleeps:
on a real SQLite file, with real threads. Every way a write transaction can end gives the turn back: a turn kept
would make the next writer wait `TURN_WAIT_SECONDS` (set to a minute here, so a leak cannot hide)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.engine import Engine
from sqlmodel import Session

from service.store import db
from service.store.db import begin_write, make_engine, session_scope, write_bind


@pytest.fixture
def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Engine]:
    monkeypatch.setattr(db, "TURN_WAIT_SECONDS", 60.0)
    eng = make_engine(f"sqlite:///{tmp_path / 'turns.db'}")
    with eng.begin() as conn:
        conn.execute(text("CREATE TABLE counter (id INTEGER PRIMARY KEY, n INTEGER NOT NULL)"))
        conn.execute(text("INSERT INTO counter VALUES (1, 0)"))
    yield eng
    eng.dispose()


def bump(engine: Engine) -> None:
    """A read-then-write: it loses updates unless writers are one at a time."""
    with session_scope(engine) as session:
        n = session.execute(text("SELECT n FROM counter WHERE id = 1")).scalar_one()
        time.sleep(0.001)
        session.execute(text("UPDATE counter SET n = :n WHERE id = 1"), {"n": n + 1})


def count(engine: Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(text("SELECT n FROM counter WHERE id = 1")).scalar_one()


def timed_write(engine: Engine) -> float:
    started = time.monotonic()
    bump(engine)
    return time.monotonic() - started


def timed_write_elsewhere(engine: Engine) -> float:
    """`timed_write` on another connection than the one the last writer gave back (which this holds meanwhile): a
    turn that connection kept would make this one wait."""
    with engine.connect():
        return timed_write(engine)


def test_many_threads_write_one_at_a_time_and_none_waits_long(engine: Engine) -> None:
    waits: list[float] = []

    def writer() -> None:
        for _ in range(25):
            waits.append(timed_write(engine))

    threads = [threading.Thread(target=writer) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert count(engine) == 200  # no update lost
    assert max(waits) < 10, f"a writer waited {max(waits):.1f}s"


def test_a_rolled_back_transaction_gives_the_turn_back(engine: Engine) -> None:
    with pytest.raises(RuntimeError), session_scope(engine) as session:
        session.execute(text("UPDATE counter SET n = 100 WHERE id = 1"))
        raise RuntimeError("the route failed")
    assert timed_write_elsewhere(engine) < 5
    assert count(engine) == 1


def test_a_session_closed_without_commit_gives_the_turn_back(engine: Engine) -> None:
    session = Session(engine)
    begin_write(session)
    session.execute(text("UPDATE counter SET n = 100 WHERE id = 1"))
    session.close()
    assert timed_write_elsewhere(engine) < 5
    assert count(engine) == 1


def test_a_connection_lost_mid_write_gives_the_turn_back(engine: Engine) -> None:
    session = Session(engine)
    begin_write(session)
    session.connection().invalidate()
    session.close()
    assert timed_write_elsewhere(engine) < 5


def test_a_write_bind_session_begins_its_write_transaction_at_its_first_statement(engine: Engine) -> None:
    seen: list[str] = []
    listener = lambda _c, _cur, statement, *_: seen.append(statement)  # noqa: E731
    from sqlalchemy import event

    event.listen(engine, "before_cursor_execute", listener)
    try:
        session = Session(write_bind(engine))
        assert seen == []  # opening it did nothing
        session.execute(text("SELECT n FROM counter"))
        session.commit()
        session.close()
        with Session(engine) as reader:
            reader.execute(text("SELECT n FROM counter"))
    finally:
        event.remove(engine, "before_cursor_execute", listener)
    assert [s for s in seen if s.startswith("BEGIN")] == ["BEGIN IMMEDIATE", "BEGIN"]
    assert db.base_engine(write_bind(engine)) is engine
    assert timed_write_elsewhere(engine) < 5  # and its turn came back
