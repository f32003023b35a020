"""The web page against a real `shunter serve` (API, dispatcher, the session's real Ray head, real DDP training), with
tokens on, in Debian's Chromium: one tab watches a real job's row go QUEUED → RUNNING → SUCCEEDED without a reload,
cancels another job from the page, opens the finished job and finds its loss chart with a point per report; a tab
with another owner's token sees neither job."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.backends.ray_local import LocalHead, free_port
from tests.service.conftest import Service, service_env, stop_leftover_ray_jobs
from tests.service.test_e2e_serve import NEVER
from tests.ui.browser import STATE_RECORDER, watch
from tests.ui.test_pages import TOKENS, expect_state, login, rows

pytestmark = pytest.mark.slow
ALICE = {"Authorization": "Bearer tok-alice"}


@pytest.fixture
def token_service(tmp_path: Path, ray_head: LocalHead) -> Iterator[Service]:
    port = free_port()
    env = service_env(tmp_path, ray_head, port, SHUNTER_API_TOKENS=json.dumps(TOKENS))
    svc = Service(data_dir=tmp_path, port=port, env=env).start()
    yield svc
    svc.stop()
    stop_leftover_ray_jobs(ray_head)


def mlp(name: str, workers: int, cpus: int = 1, **config: Any) -> dict[str, Any]:
    return {
        "name": name,
        "entrypoint": {"callable": "examples.mlp:train_loop"},
        "config": {"total_steps": 30, "checkpoint_every": 10, "report_every": 5, **config},
        "strategy": {"kind": "ddp"},
        "resources": {"num_workers": workers, "resources_per_worker": {"CPU": cpus}},
        "checkpoint": {"keep": 2},
    }


def submit(svc: Service, body: dict[str, Any]) -> str:
    r = httpx.post(f"{svc.url}/v1/jobs", json=body, headers=ALICE, timeout=30)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def test_a_real_job_on_the_page(token_service: Service, context: Any, browser: Any, tmp_path: Path) -> None:
    svc = token_service
    printed = svc.log_path.read_text()
    dashboard = svc.env["SHUNTER_RAY_DASHBOARD_URL"]
    assert f"shunter: API {svc.url}  web page {svc.url}/ui  Ray dashboard {dashboard}" in printed
    w = watch(context)
    login(w, f"{svc.url}/ui", "tok-alice")
    w.page.wait_for_selector("#empty:not([hidden])")
    w.page.evaluate(STATE_RECORDER)
    load = w.page.evaluate("window.__pageLoad")

    # A job that holds all 4 CPUs of the session's Ray head, so the next one must wait in the queue: one worker of
    # 4 CPUs (holding room needs no more worker processes, ~3 CPU-s each to start; issue 34).
    blocker = submit(svc, mlp("blocker", 1, cpus=4, total_steps=100_000, step_sleep=0.05, checkpoint_every=NEVER))
    w.page.wait_for_selector(f'tr[data-job-id="{blocker}"] .state[data-state="RUNNING"]', timeout=180_000)
    job = submit(svc, mlp("mlp-page", 2, step_sleep=0.1))
    expect_state(w, job, "QUEUED")
    w.page.screenshot(path=tmp_path / "queue-waiting.png")

    # Cancel the blocker from the page: two clicks (the first asks to confirm).
    cancel = f'tr[data-job-id="{blocker}"] button[data-action="cancel"]'
    w.page.click(cancel)
    w.page.click(cancel)
    w.page.wait_for_selector(f'tr[data-job-id="{blocker}"] .state[data-state="CANCELLED"]', timeout=120_000)

    # The queued job is admitted once the blocker is gone, trains, and ends; the row follows it live.
    w.page.wait_for_selector(f'tr[data-job-id="{job}"] .state[data-state="SUCCEEDED"]', timeout=240_000)
    seen = w.page.evaluate("window.__seen")
    assert seen[blocker][-2:] == ["CANCELLING", "CANCELLED"], seen[blocker]
    states = seen[job]
    assert states[0] == "QUEUED" and states[-1] == "SUCCEEDED" and "RUNNING" in states, states
    assert states.index("QUEUED") < states.index("RUNNING") < states.index("SUCCEEDED")
    assert w.page.evaluate("window.__pageLoad") == load  # never reloaded
    assert w.most_streams == 1 and len(w.streams_started()) == 1
    api = httpx.get(f"{svc.url}/v1/jobs/{blocker}", headers=ALICE, timeout=10).json()
    assert api["state"] == "CANCELLED" and api["end_reason"] == "cancelled"
    w.page.screenshot(path=tmp_path / "queue.png")

    # The job's page: one loss series (one attempt) with a point per report (report_every 5 of 30 steps).
    w.page.click(f'tr[data-job-id="{job}"] a.name')
    w.page.wait_for_selector('#job-state .state[data-state="SUCCEEDED"]')
    w.page.wait_for_function("() => window.shunterCharts.loss !== undefined")
    steps, losses = w.page.evaluate("window.shunterCharts.loss.data.map(s => s.slice())")
    assert steps == [5, 10, 15, 20, 25, 30] and len(losses) == 6 and all(v is not None for v in losses)
    served = httpx.get(f"{svc.url}/v1/jobs/{job}/metrics?name=loss", headers=ALICE, timeout=10).json()
    assert losses == pytest.approx([m["value"] for m in served])
    w.page.wait_for_selector("#logs:has-text('done: 30 steps')")
    href = w.page.get_attribute('tr[data-attempt="1"] a', "href")
    assert href == f"{svc.env['SHUNTER_RAY_DASHBOARD_URL']}/#/jobs/shunter-{job}-1"
    assert w.page.eval_on_selector_all("#checkpoint-rows tr", "n => n.length") == 3
    w.page.screenshot(path=tmp_path / "job.png", full_page=True)
    assert w.csp_violations() == [] and w.errors == []

    # Bob sees neither job, in the list or by link.
    other = browser.new_context()
    try:
        b = watch(other)
        login(b, f"{svc.url}/ui", "tok-bob")
        b.page.wait_for_selector("#empty:not([hidden])")
        assert rows(b) == []
        for target in (job, blocker):
            b.page.goto(f"{svc.url}/ui/jobs/{target}")
            b.page.wait_for_selector("#notice:not([hidden])")
            assert "no job" in (b.page.text_content("#notice") or "") and b.page.is_hidden("#main")
    finally:
        other.close()
