"""Fixtures of the browser tests: one headless Chromium per test process (xdist worker), a fresh browser context
(its own sessionStorage) per test, and a real SQLite database per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import Engine

from service.store.db import make_engine
from service.store.migrate import upgrade
from tests.service.conftest import service  # noqa: F401 - re-exported for the end-to-end test
from tests.ui.browser import VIEWPORT, chromium


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    with chromium() as b:
        yield b


@pytest.fixture
def context(browser: Any) -> Iterator[Any]:
    ctx = browser.new_context(viewport=VIEWPORT)
    ctx.set_default_timeout(15_000)
    yield ctx
    ctx.close()


@pytest.fixture
def sqlite_db(tmp_path: Path) -> Iterator[Engine]:
    engine = make_engine(f"sqlite:///{tmp_path / 'shunter.db'}")
    upgrade(engine)
    yield engine
    engine.dispose()
