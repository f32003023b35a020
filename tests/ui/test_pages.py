"""The web page in a real browser (Debian's Chromium, via Playwright) against a real API over a real SQLite file: the
queue list from one plain request and then live from the event stream, tokens asked for and kept in sessionStorage
(never in a URL), cancel from the page, another owner's token seeing none of it, the job view's charts across
attempts, the cluster view, user text shown as text, and the Content-Security-Policy."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session

from api.routes.ui import CSP, STATIC
from service.dispatch.host_files import HostFiles
from service.store.models import ClusterSnapshot, EndReason, JobState, NodeFault
from tests.live_api import live_api
from tests.ui import data
from tests.ui.browser import STATE_RECORDER, Watched, watch

UNSAFE_JS = re.compile(r"\.(inner|outer)HTML\b|insertAdjacentHTML|document\.write|\beval\(|new Function")
TOKENS = {"tok-alice": {"owner": "alice"}, "tok-bob": {"owner": "bob"}}
CSP_REQUIRED = ("script-src 'self'", "style-src 'self'", "connect-src 'self'", "img-src 'self' data:",
                "frame-ancestors 'none'", "base-uri 'none'", "object-src 'none'")  # fmt: skip


def rows(w: Watched) -> list[str]:
    return list(w.page.eval_on_selector_all("#job-rows tr", "trs => trs.map(t => t.dataset.jobId)"))


def state_of(w: Watched, job_id: str) -> str:
    return str(w.page.get_attribute(f'tr[data-job-id="{job_id}"] .state', "data-state"))


def expect_state(w: Watched, job_id: str, state: str) -> None:
    w.page.wait_for_selector(f'tr[data-job-id="{job_id}"] .state[data-state="{state}"]')


def login(w: Watched, url: str, token: str) -> None:
    w.page.goto(url)
    w.page.wait_for_selector("#login:not([hidden])")
    assert w.page.is_hidden("#main")
    w.page.fill("#token-input", token)
    w.page.click("#token-save")
    w.page.wait_for_selector("#main:not([hidden])")


def test_every_ui_answer_has_the_csp_and_the_page_has_no_inline_script(sqlite_db: Engine, tmp_path: Path) -> None:
    with live_api(sqlite_db, tmp_path) as api:
        for path in ("/ui", "/ui/jobs/j0123", "/ui/cluster", "/ui/static/common.js", "/ui/static/app.css",
                     "/ui/static/vendor/uPlot.iife.min.js"):  # fmt: skip
            r = httpx.get(api.url + path, timeout=10)
            assert r.status_code == 200, path
            policy = r.headers["content-security-policy"]
            assert policy == CSP and all(part in policy for part in CSP_REQUIRED), path
            assert "unsafe" not in policy
            assert r.headers["x-content-type-options"] == "nosniff"
        assert httpx.get(api.url + "/ui/static/nope.js", timeout=10).status_code == 404
        assert httpx.get(api.url + "/ui/jobs/..%2Fetc", timeout=10).status_code in (404, 422)
    for html in STATIC.glob("*.html"):
        text = html.read_text()
        assert not re.search(r"<script(?![^>]*\bsrc=)", text), f"inline script in {html.name}"
        assert " style=" not in text and "<style" not in text, f"inline style in {html.name}"
        assert not re.search(r"\son[a-z]+=", text), f"inline handler in {html.name}"
    for script in STATIC.glob("*.js"):
        code = script.read_text()
        assert not UNSAFE_JS.search(code), f"{script.name}: {UNSAFE_JS.search(code)}"


def test_queue_with_tokens_live_updates_cancel_and_another_owner(
    sqlite_db: Engine, tmp_path: Path, context: Any, browser: Any
) -> None:
    with live_api(sqlite_db, tmp_path, api_tokens=TOKENS) as api:
        first = data.submit(api, data.spec("first"), "tok-alice")
        second = data.submit(api, data.spec("second", priority=5), "tok-alice")
        w = watch(context)
        login(w, f"{api.url}/ui", "tok-alice")
        w.page.wait_for_selector(f'tr[data-job-id="{first["id"]}"]')
        assert rows(w) == [second["id"], first["id"]]  # both queued: in admission order (priority first)
        assert w.page.text_content(f'tr[data-job-id="{second["id"]}"] td:nth-child(6)') == "1 (1 overall)"
        w.page.wait_for_function("() => document.getElementById('live').classList.contains('on')")

        # The list came from one plain GET, answered before the page's one stream began.
        assert [e for e in w.order if e.startswith("start ")][0] == f"start {api.url}/v1/jobs?limit=500&positions=true"
        listed = w.order.index(f"end {api.url}/v1/jobs?limit=500&positions=true")
        streamed = w.order.index(next(e for e in w.order if "follow=true" in e))
        assert listed < streamed
        assert [u for u in w.streams_started()] == [f"{api.url}/v1/events?follow=true&after=2"]
        # The token is a header, never a URL; kept in this tab's sessionStorage only.
        api_requests = [(url, h.get("authorization")) for url, h in w.requests if "/v1/" in url]
        # before the token: 401, the form
        assert api_requests[0] == (f"{api.url}/v1/jobs?limit=500&positions=true", None)
        assert {auth for _, auth in api_requests[1:]} == {"Bearer tok-alice"}
        assert not any("tok-alice" in url for url, _ in w.requests)
        assert w.page.evaluate("sessionStorage.getItem('shunter.token')") == "tok-alice"
        assert w.page.evaluate("localStorage.length") == 0 and context.cookies() == []

        # Live: a new job appears, an admitted one moves, without a reload.
        w.page.evaluate(STATE_RECORDER)
        third = data.submit(api, data.spec("third"), "tok-alice")
        w.page.wait_for_selector(f'tr[data-job-id="{third["id"]}"]')
        started = data.admit(sqlite_db, api.settings, cpus_per_node=1)  # room for one 2-worker job: `second`
        assert started == [second["id"]]
        expect_state(w, second["id"], "STARTING")
        data.train(api, second["id"], 1, [(1, 0.5)])
        expect_state(w, second["id"], "RUNNING")
        w.page.wait_for_selector(f'tr[data-job-id="{second["id"]}"] td:nth-child(10):text("0.5000")')
        assert w.page.evaluate("window.__seen")[second["id"]] == ["QUEUED", "STARTING", "RUNNING"]

        # Cancel from the page (two clicks: the first asks to confirm).
        cancel = f'tr[data-job-id="{first["id"]}"] button[data-action="cancel"]'
        w.page.click(cancel)
        assert w.page.text_content(cancel) == "Confirm cancel"
        assert state_of(w, first["id"]) == "QUEUED"
        w.page.click(cancel)
        expect_state(w, first["id"], "CANCELLED")
        w.page.wait_for_selector(f'tr[data-job-id="{first["id"]}"] button[data-action="retry"]')
        assert (
            httpx.get(f"{api.url}/v1/jobs/{first['id']}", headers={"Authorization": "Bearer tok-alice"}).json()["state"]
            == "CANCELLED"
        )
        assert w.page.evaluate("window.__seen")[first["id"]] == ["QUEUED", "CANCELLED"]
        assert w.most_streams == 1 and len(w.streams_started()) == 1  # one stream for the whole page's life
        assert w.csp_violations() == [] and w.errors == []

        # Another owner's token: a fresh tab that sees none of alice's jobs, live or by link.
        other = browser.new_context()
        try:
            b = watch(other)
            login(b, f"{api.url}/ui", "tok-bob")
            b.page.wait_for_selector("#empty:not([hidden])")
            assert rows(b) == []
            data.move(sqlite_db, second["id"], JobState.SUCCEEDED, "succeeded", end_reason=EndReason.SUCCEEDED)
            expect_state(w, second["id"], "SUCCEEDED")  # alice's page hears of it ...
            b.page.wait_for_timeout(1500)
            assert rows(b) == []  # ... bob's does not
            b.page.goto(f"{api.url}/ui/jobs/{second['id']}")
            b.page.wait_for_selector("#notice:not([hidden])")
            assert "no job" in (b.page.text_content("#notice") or "")
            assert b.page.is_hidden("#main") and second["name"] not in b.page.content()
            assert "alice" not in b.page.content()
        finally:
            other.close()

        # A wrong token is refused and asked for again; forgetting it asks again.
        w.page.evaluate("sessionStorage.setItem('shunter.token', 'tok-nobody')")
        w.page.reload()
        w.page.wait_for_selector("#login:not([hidden])")
        assert "unknown token" in (w.page.text_content("#login-error") or "")
        login(w, f"{api.url}/ui", "tok-alice")
        w.page.click("#forget-token")
        w.page.wait_for_selector("#login:not([hidden])")
        assert w.page.evaluate("sessionStorage.getItem('shunter.token')") is None


def test_job_view_charts_each_attempt_and_shows_checkpoints(sqlite_db: Engine, tmp_path: Path, context: Any) -> None:
    with live_api(sqlite_db, tmp_path) as api:  # no tokens: the page never asks for one
        data.snapshot(sqlite_db, dashboard_url="http://ray-head:8265")
        job = data.submit(api, data.spec("two-attempts"))
        assert data.admit(sqlite_db, api.settings) == [job["id"]]
        data.train(api, job["id"], 1, [(s, 1.0 / s) for s in range(1, 13)], checkpoint_every=5)  # 12 points
        data.end_attempt(sqlite_db, job["id"], EndReason.NODE_LOST, "node 10.0.0.12 died")
        data.move(sqlite_db, job["id"], JobState.QUEUED, "node_lost", message="retrying from checkpoint 10")
        w = watch(context)
        w.page.goto(f"{api.url}/ui/jobs/{job['id']}")
        w.page.wait_for_selector("#main:not([hidden])")
        assert w.page.is_hidden("#login")
        assert data.admit(sqlite_db, api.settings) == [job["id"]]
        data.train(api, job["id"], 2, [(s, 0.5 / s) for s in range(10, 18)], checkpoint_every=5)  # 8 points
        w.page.wait_for_selector('#job-state .state[data-state="RUNNING"]')
        w.page.wait_for_function("() => window.shunterCharts.loss && window.shunterCharts.loss.series.length === 3")
        w.page.wait_for_function(
            "() => window.shunterCharts.loss.data[2].filter(v => v !== null).length === 8", timeout=10_000
        )
        loss = w.page.evaluate("(() => { const d = window.shunterCharts.loss.data; return d.map(s => s.slice()); })()")
        steps, first, second = loss
        assert steps == list(range(1, 18))
        assert [v for v in first if v is not None] == pytest.approx([1.0 / s for s in range(1, 13)])
        assert [v for v in second if v is not None] == pytest.approx([0.5 / s for s in range(10, 18)])
        labels = w.page.evaluate("window.shunterCharts.loss.series.map(s => s.label)")
        assert labels == ["step", "attempt 1", "attempt 2"]
        assert drawn(w, "loss")
        assert set(w.page.evaluate("Object.keys(window.shunterCharts)")) == {"loss", "throughput"}
        # Attempts with end reasons and links to Ray; checkpoints with completeness.
        w.page.wait_for_selector('tr[data-attempt="2"]')
        first_row = w.page.text_content('tr[data-attempt="1"]') or ""
        assert "node_lost" in first_row and "node 10.0.0.12 died" in first_row
        href = w.page.get_attribute('tr[data-attempt="2"] a', "href")
        assert href == f"http://ray-head:8265/#/jobs/shunter-{job['id']}-2"
        stored = httpx.get(f"{api.url}/v1/jobs/{job['id']}/checkpoints", timeout=10).json()
        assert [(c["attempt"], c["step"]) for c in stored] == [(1, 5), (1, 10), (2, 10), (2, 15)]
        w.page.wait_for_function("() => document.querySelectorAll('#checkpoint-rows tr').length === 4")
        shown = w.page.eval_on_selector_all("#checkpoint-rows tr", "trs => trs.map(t => t.children[3].textContent)")
        assert shown == [("complete" if c["complete"] else "incomplete") + (", pruned" if c["pruned"] else "")
                         for c in stored]  # fmt: skip
        timeline = w.page.text_content("#event-rows") or ""
        assert "QUEUED → STARTING" in timeline and "retrying from checkpoint 10" in timeline
        assert '"total_steps": 30' in (w.page.text_content("#job-spec") or "")
        assert w.most_streams == 1
        assert w.streams_started()[0].startswith(f"{api.url}/v1/jobs/{job['id']}/events?follow=true&after=")
        # The job ends: its stream ends with it, and the page says so without a reload.
        data.move(sqlite_db, job["id"], JobState.SUCCEEDED, "succeeded", end_reason=EndReason.SUCCEEDED)
        w.page.wait_for_selector('#job-state .state[data-state="SUCCEEDED"]')
        w.page.wait_for_function("() => !document.getElementById('live').classList.contains('on')")
        assert w.page.is_hidden("#job-cancel") and w.page.is_hidden("#job-retry")
        assert w.csp_violations() == [] and w.errors == []
        w.page.screenshot(path=tmp_path / "job.png", full_page=True)


def drawn(w: Watched, metric: str) -> bool:
    """Whether the chart's canvas has lines on it (pixels of the series colour), not just an empty frame."""
    return bool(
        w.page.evaluate(
            """(name) => {
                const c = window.shunterCharts[name].ctx.canvas;
                const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                let blue = 0;
                for (let i = 0; i < d.length; i += 4) if (d[i] < 80 && d[i + 1] < 120 && d[i + 2] > 150) blue++;
                return blue > 50;
            }""",
            metric,
        )
    )


HOSTILE = '<img src=x onerror="window.__pwned=1"></pre><script>window.__pwned=2</script><b>bold</b>'
HOSTILE_METRIC = "<svg onload=window.__pwned=3>"


def test_user_text_is_shown_as_text_and_never_runs(sqlite_db: Engine, tmp_path: Path, context: Any) -> None:
    """A job's config, its metric names, its end message and its log are the user's text (names and queues are
    checked at submission): each shows literally, and nothing in them runs."""
    with live_api(sqlite_db, tmp_path) as api:
        job = data.submit(api, data.spec("hostile", config={"note": HOSTILE, "total_steps": 3}))
        data.admit(sqlite_db, api.settings)
        reporter = api.attempt_api(job["id"], 1)
        assert reporter.report({HOSTILE_METRIC: 1.0, "loss": 2.0}, step=1)
        data.end_attempt(sqlite_db, job["id"], EndReason.USER_ERROR, HOSTILE)
        log = HostFiles(api.settings.data_dir).log_path(job["id"], 1)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(f"step 1\n{HOSTILE}\nTraceback: boom\n")
        data.move(sqlite_db, job["id"], JobState.FAILED, "user_error", message=HOSTILE,
                  end_reason=EndReason.USER_ERROR, last_error=HOSTILE)  # fmt: skip
        w = watch(context)
        w.page.goto(f"{api.url}/ui")
        w.page.wait_for_selector(f'tr[data-job-id="{job["id"]}"]')
        assert HOSTILE in (w.page.text_content(f'tr[data-job-id="{job["id"]}"]') or "")
        w.page.goto(f"{api.url}/ui/jobs/{job['id']}")
        w.page.wait_for_selector('tr[data-attempt="1"]')
        assert f'"note": {json.dumps(HOSTILE)}' in (w.page.text_content("#job-spec") or "")
        assert HOSTILE in (w.page.text_content('tr[data-attempt="1"]') or "")
        assert HOSTILE in (w.page.text_content('dd[data-fact="Last error"]') or "")
        w.page.wait_for_selector("#logs:has-text('Traceback: boom')")
        assert HOSTILE in (w.page.text_content("#logs") or "")
        assert w.page.text_content(f'.chart[data-metric="{HOSTILE_METRIC}"] h3') == HOSTILE_METRIC
        for page_url in (f"{api.url}/ui", f"{api.url}/ui/jobs/{job['id']}"):
            w.page.goto(page_url)
            w.page.wait_for_selector("#main:not([hidden])")
            w.page.wait_for_timeout(300)
            assert w.page.evaluate("window.__pwned") is None
            assert w.page.eval_on_selector_all("main img, main svg, main b, main script", "n => n.length") == 0
        assert w.csp_violations() == [] and w.errors == []


def test_cluster_view(sqlite_db: Engine, tmp_path: Path, context: Any) -> None:
    with live_api(sqlite_db, tmp_path, api_tokens=TOKENS) as api:
        data.snapshot(sqlite_db, free=1.0)
        mine = data.submit(api, data.spec("mine"), "tok-alice")
        theirs = data.submit(api, data.spec("theirs"), "tok-bob")
        assert sorted(data.admit(sqlite_db, api.settings)) == sorted([mine["id"], theirs["id"]])
        w = watch(context)
        login(w, f"{api.url}/ui/cluster", "tok-alice")
        w.page.wait_for_selector("tr[data-node]")
        assert w.page.eval_on_selector_all("#node-rows tr", "n => n.length") == 2
        assert "1 / 4" in (w.page.text_content(f'tr[data-node="{data.NODES[0][0]}"]') or "")
        assert "8 / 16" in (w.page.text_content(f'tr[data-node="{data.NODES[0][0]}"]') or "")  # GiB
        cpu = w.page.text_content('tr[data-resource="CPU"]') or ""
        assert "2" in cpu and "8" in cpu
        assert w.page.eval_on_selector_all("#running-rows tr", "n => n.map(t => t.dataset.jobId)") == [mine["id"]]
        assert w.page.get_attribute("#dashboard", "href") == "http://127.0.0.1:8265/"
        assert "default" in (w.page.text_content("#queue-rows") or "")
        assert w.page.is_hidden("#excluded-section")  # no node is kept out: no section
        # Node b failed the pre-flight check for jobs of two owners (issue 17): kept out of everyone's admissions.
        third = data.submit(api, data.spec("third"), "tok-alice")
        bad = data.NODES[1][0]
        with Session(sqlite_db) as session:
            for job in (mine, theirs, third):
                session.add(NodeFault(node_id=bad, job_id=job["id"], attempt=1, reason="preflight_failed",
                                      address=data.NODES[1][1]))  # fmt: skip
            session.commit()
        w.page.reload()
        w.page.wait_for_selector("#excluded-section:not([hidden])")
        row = w.page.text_content("#excluded-rows") or ""
        assert bad[:12] in row and "3 jobs failed there (preflight_failed)" in row
        assert w.page.is_hidden("#scale-section")  # nothing asked of an autoscaler (issue 37)
        with Session(sqlite_db) as session:
            snap = session.get(ClusterSnapshot, 1)
            assert snap is not None
            snap.scale_request = {"bundles": [{"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}], "jobs": 2,
                                  "asked_at": "2030-01-01T00:00:00+00:00"}  # fmt: skip
            session.add(snap)
            session.commit()
        w.page.reload()
        w.page.wait_for_selector("#scale-section:not([hidden])")
        assert "3 bundles for 2 waiting job(s)" in (w.page.text_content("#scale-summary") or "")
        assert w.page.eval_on_selector_all("#scale-rows tr", "n => n.length") == 2  # two shapes: 2 x CPU, 1 x CPU+GPU
        assert w.most_streams == 0 and w.csp_violations() == [] and w.errors == []


def test_the_started_line_names_the_page() -> None:
    """`shunter serve` / `shunter api` print this once up (the slow test reads it from a real `shunter serve`)."""
    from api.launchers import where
    from service.config.settings import Settings

    line = where(Settings(host="127.0.0.1", port=8080), "http://127.0.0.1:8265")
    assert (
        line
        == "shunter: API http://127.0.0.1:8080  web page http://127.0.0.1:8080/ui  Ray dashboard http://127.0.0.1:8265"
    )
    assert "http://[::1]:9000/ui" in where(Settings(host="::1", port=9000), None)
