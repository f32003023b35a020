"""Counting SQL statements and commits: in this process (`Counter`), or in a child `shunter` process
(`python -m bench.statements COUNT_FILE ARGS...`, which writes its totals to COUNT_FILE every 0.1 s).

A statement is one `cursor.execute`/`executemany` call (a batched INSERT of many rows counts once): the round trips
the database serves, which is what bounds claims/s on a shared machine.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections import Counter as Tally
from pathlib import Path
from typing import Any

_WORDS = re.compile(r"^\s*(\w+)(?:.*?\b(?:FROM|INTO|UPDATE)\s+(\w+))?", re.S | re.I)


def _shape(statement: str) -> str:
    """ "SELECT jobs", "UPDATE jobs", "INSERT job_events": what a statement does to which table."""
    m = _WORDS.match(statement)
    if m is None:
        return statement[:20]
    verb = m.group(1).upper()
    table = statement.split()[1] if verb == "UPDATE" else m.group(2) or ""
    return f"{verb} {table}".strip()


class Counter:
    """Statements and commits from `install()` on (thread-safe)."""

    def __init__(self) -> None:
        self.statements = 0
        self.commits = 0
        self.shapes: Tally[str] = Tally()
        self._lock = threading.Lock()

    def install(self, engine: Any = None) -> Counter:
        """Count `engine`'s statements (default: every engine of this process)."""
        from sqlalchemy import event
        from sqlalchemy.engine import Engine

        target = engine if engine is not None else Engine
        event.listen(target, "before_cursor_execute", self._on_statement)
        event.listen(target, "commit", self._on_commit)
        return self

    def _on_statement(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        with self._lock:
            self.statements += 1
            self.shapes[_shape(statement)] += 1

    def _on_commit(self, conn: Any) -> None:
        with self._lock:
            self.commits += 1

    def totals(self) -> tuple[int, int]:
        with self._lock:
            return self.statements, self.commits


def read(path: Path) -> tuple[int, int]:
    """The totals a child last wrote to `path` ((0, 0) before its first write)."""
    try:
        statements, commits = path.read_text().split()
    except (FileNotFoundError, ValueError):
        return 0, 0
    return int(statements), int(commits)


def main() -> None:
    path, args = Path(sys.argv[1]), sys.argv[2:]
    counter = Counter().install()

    def write() -> None:
        while True:
            tmp = path.with_suffix(".tmp")
            done, commits = counter.totals()
            tmp.write_text(f"{done} {commits}")
            os.replace(tmp, path)
            threading.Event().wait(0.1)

    threading.Thread(target=write, daemon=True, name="count-writer").start()
    from api.cli import app

    sys.argv = ["shunter", *args]
    app()


if __name__ == "__main__":
    main()
