"""Refresh the README's screenshots of the web page: `python -m tests.ui.screenshots [folder]` (default docs/).

A real API over a temporary SQLite file, filled the way the service fills it (tests/ui/data.py: jobs submitted over
HTTP by three owners, admitted, reporting through the attempt API, one retried after a lost node, one failed, one
cancelled), photographed in Debian's Chromium as an admin sees it: docs/ui-queue.png, ui-job.png, ui-cluster.png.
"""

from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path

import httpx

from service.store.db import make_engine
from service.store.migrate import upgrade
from service.store.models import EndReason, JobState
from tests.live_api import LiveApi, live_api
from tests.ui import data
from tests.ui.browser import VIEWPORT, chromium

TOKENS = {
    "t-alice": {"owner": "alice", "team": "nlp"},
    "t-bob": {"owner": "bob", "team": "vision"},
    "t-carol": {"owner": "carol", "team": "nlp"},
    "t-ops": {"owner": "ops", "admin": True},
}


def curve(start: int, end: int, scale: float, offset: float = 0.0) -> list[tuple[int, float]]:
    return [(s, offset + scale * math.exp(-s / 40) + 0.02 * math.sin(s)) for s in range(start, end + 1, 5)]


def populate(api: LiveApi) -> str:
    """Jobs in every state the queue view shows; returns the id of the one with two attempts."""
    engine, settings = api.engine, api.settings
    data.snapshot(engine, dashboard_url="http://ray-head:8265", free=0.0)
    done = data.submit(api, data.spec("mlp-ddp", config={"total_steps": 60}), "t-alice")["id"]
    data.admit(engine, settings, cpus_per_node=2)
    data.train(api, done, 1, curve(5, 60, 1.2))
    data.end_attempt(engine, done, EndReason.SUCCEEDED, "Job finished successfully.")
    data.move(engine, done, JobState.SUCCEEDED, "succeeded", end_reason=EndReason.SUCCEEDED)

    failed = data.submit(api, data.spec("vit-fsdp", strategy={"kind": "fsdp"}), "t-bob")["id"]
    data.admit(engine, settings, cpus_per_node=2)
    data.train(api, failed, 1, curve(5, 15, 2.0))
    error = "ValueError: image size 384 does not match the patch grid (expected 224)"
    data.end_attempt(engine, failed, EndReason.USER_ERROR, error)
    data.move(engine, failed, JobState.FAILED, "user_error", message=error, end_reason=EndReason.USER_ERROR,
              last_error=error)  # fmt: skip

    retried = data.submit(api, data.spec("gpt2-zero3", priority=5, config={"total_steps": 200},
                                         strategy={"kind": "deepspeed"}), "t-alice")["id"]  # fmt: skip
    data.admit(engine, settings, cpus_per_node=2)
    data.train(api, retried, 1, curve(5, 80, 3.0, 0.3), checkpoint_every=40)
    data.end_attempt(engine, retried, EndReason.NODE_LOST, "node 10.0.0.12 left the cluster (raylet died)")
    data.move(engine, retried, JobState.QUEUED, "node_lost", message="retrying from checkpoint at step 80")
    data.admit(engine, settings, cpus_per_node=2)
    data.train(api, retried, 2, curve(80, 145, 3.0, 0.3), checkpoint_every=40)

    running = data.submit(api, data.spec("resnet50-ddp", queue="gpu"), "t-bob")["id"]
    data.admit(engine, settings, cpus_per_node=2)
    data.train(api, running, 1, curve(5, 35, 1.8))

    gone = data.submit(api, data.spec("bert-base-sweep-3"), "t-carol")["id"]
    r = httpx.post(f"{api.url}/v1/jobs/{gone}/cancel", headers={"Authorization": "Bearer t-carol"}, timeout=10)
    assert r.status_code == 202, r.text
    data.submit(api, data.spec("llama-8b-lora", priority=10), "t-carol")
    data.submit(api, data.spec("t5-small-distill"), "t-alice")
    data.submit(api, data.spec("whisper-ft", queue="gpu"), "t-bob")
    return retried


def take(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        engine = make_engine(f"sqlite:///{Path(tmp) / 'shunter.db'}")
        upgrade(engine)
        queues = {"default": {}, "gpu": {"max_gpus": 16}}
        with live_api(engine, Path(tmp), api_tokens=TOKENS, queues=queues) as api, chromium() as browser:
            job = populate(api)
            page = browser.new_context(viewport=VIEWPORT).new_page()
            page.goto(f"{api.url}/ui")
            page.fill("#token-input", "t-ops")
            page.click("#token-save")
            page.wait_for_selector("#job-rows tr")
            page.wait_for_timeout(800)
            shots = [folder / "ui-queue.png", folder / "ui-job.png", folder / "ui-cluster.png"]
            page.screenshot(path=shots[0])
            page.goto(f"{api.url}/ui/jobs/{job}")
            page.wait_for_selector(".chart canvas")
            page.wait_for_timeout(800)
            page.screenshot(path=shots[1])
            page.goto(f"{api.url}/ui/cluster")
            page.wait_for_selector("#node-rows tr")
            page.wait_for_timeout(300)
            page.screenshot(path=shots[2])
        engine.dispose()
    return shots


if __name__ == "__main__":
    for shot in take(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[2] / "docs"):
        print(f"{shot} ({shot.stat().st_size // 1024} KiB)")
