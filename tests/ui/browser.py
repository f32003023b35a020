"""Debian's Chromium driven by Playwright (never a downloaded browser: `playwright install` is not used), and what
the browser tests read off a page: requests it made, streams it held open, CSP violations, states a row went through.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

CHROMIUM = os.environ.get("SHUNTER_CHROMIUM", "/usr/bin/chromium")
# Without the background-networking flags Chromium dials out at start (updates, sync, QUIC probes); on a cluster
# node or CI box with no internet those connections are refused and slow every launch.
ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-default-apps",
    "--disable-extensions",
]  # fmt: skip
VIEWPORT = {"width": 1280, "height": 800}

# Before any script of the page: every CSP violation, and an id that a reload would lose.
WATCH_SCRIPT = """
window.__csp = [];
document.addEventListener('securitypolicyviolation', e => window.__csp.push(e.violatedDirective + ' ' + e.blockedURI));
window.__pageLoad = Math.random();
"""
# Records, for every row of the queue table, each state its badge shows, as it changes.
STATE_RECORDER = """
() => {
  window.__seen = {};
  const note = () => {
    for (const tr of document.querySelectorAll('#job-rows tr[data-job-id]')) {
      const id = tr.dataset.jobId, state = tr.querySelector('.state').dataset.state, seen = window.__seen[id] ||= [];
      if (seen[seen.length - 1] !== state) seen.push(state);
    }
  };
  note();
  new MutationObserver(note).observe(document.getElementById('job-rows'), {childList: true, subtree: true,
                                                                          characterData: true, attributes: true});
}
"""


def require_chromium() -> str:
    """The system Chromium; a clear failure where it is missing (CI installs it: .ci/run), a skip only when asked."""
    if shutil.which(CHROMIUM) or os.path.exists(CHROMIUM):
        return CHROMIUM
    if os.environ.get("SHUNTER_BROWSER_TESTS") == "skip":
        pytest.skip(f"{CHROMIUM} is not installed and SHUNTER_BROWSER_TESTS=skip")
    pytest.fail(
        f"the browser tests need Debian's Chromium at {CHROMIUM}: `apt-get install -y chromium chromium-driver` "
        "(.ci/run does it), or set SHUNTER_BROWSER_TESTS=skip to skip them on this machine"
    )


@contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium of its own (Playwright gives each launch a fresh temporary profile, its user-data-dir)."""
    from playwright.sync_api import sync_playwright

    path = require_chromium()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=path, headless=True, args=ARGS)
        try:
            yield browser
        finally:
            browser.close()


@dataclass
class Watched:
    """A page and what it did: every request URL and its headers, and the follow streams it held open at once."""

    page: Any
    requests: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    order: list[str] = field(default_factory=list)  # "start <url>" / "end <url>" for API requests, in order
    open_streams: int = 0
    most_streams: int = 0
    errors: list[str] = field(default_factory=list)

    def csp_violations(self) -> list[str]:
        return list(self.page.evaluate("window.__csp"))

    def streams_started(self) -> list[str]:
        return [entry[6:] for entry in self.order if entry.startswith("start ") and "follow=true" in entry]


def watch(context: Any) -> Watched:
    """A new page of `context` with its requests, streams, errors and CSP violations recorded."""
    page = context.new_page()
    watched = Watched(page)
    page.add_init_script(WATCH_SCRIPT)

    def started(request: Any) -> None:
        watched.requests.append((request.url, dict(request.headers)))
        if "/v1/" in request.url:
            watched.order.append(f"start {request.url}")
            if "follow=true" in request.url:
                watched.open_streams += 1
                watched.most_streams = max(watched.most_streams, watched.open_streams)

    def ended(request: Any) -> None:
        if "/v1/" in request.url:
            watched.order.append(f"end {request.url}")
            if "follow=true" in request.url:
                watched.open_streams -= 1

    page.on("request", started)
    page.on("requestfinished", ended)
    page.on("requestfailed", ended)
    page.on("pageerror", lambda exc: watched.errors.append(str(exc)))
    return watched
