"""/v1/sweeps over real HTTP (a real uvicorn app) on SQLite and PostgreSQL: 422s that name the field, members that are
ordinary jobs (GET /v1/jobs/{id} shows their sweep), replays, ownership (404 for others, admins see all), the best
member from metrics the members report through the attempt API, cancel of a whole sweep, and `shunter sweep
submit / status / cancel` through the real client."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import yaml
from sqlalchemy.engine import Engine
from typer.testing import CliRunner

from api.cli import app as cli
from tests.live_api import live_api
from tests.service.test_sweeps import _admit

TOKENS = {"tok-alice": {"owner": "alice"}, "tok-bob": {"owner": "bob"}, "tok-root": {"owner": "ops", "admin": True}}
BASE: dict[str, Any] = {"name": "mlp", "entrypoint": {"callable": "examples.mlp:train_loop"},
                        "config": {"total_steps": 4}}  # fmt: skip
NOW = datetime(2026, 12, 2, 9, 0, tzinfo=timezone.utc)


def call(url: str, method: str, path: str, token: str = "tok-alice", **kwargs: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}", **kwargs.pop("headers", {})}
    return httpx.request(method, f"{url}{path}", headers=headers, timeout=30, **kwargs)


BAD: list[tuple[dict[str, Any], str]] = [
    ({"base": BASE}, "grid"),
    ({"base": BASE, "grid": {"lr": []}}, "grid.lr"),
    ({"base": BASE, "grid": {"lr": "0.1"}}, "grid.lr"),
    ({"base": BASE, "grid": {"name": ["x"]}}, "grid.name"),
    ({"base": BASE, "points": []}, "points"),
    ({"base": BASE, "count": 2, "max_parallel": 0}, "max_parallel"),
    ({"base": BASE, "count": 2, "metric": {"name": "loss", "mode": "up"}}, "metric.mode"),
    ({"base": {**BASE, "resources": {"num_workers": 0}}, "count": 2}, "base.resources.num_workers"),
    ({"count": 2}, "base"),
    # a member's own value: its member and its key are named
    ({"base": BASE, "grid": {"resources.num_workers": [1, 0]}}, "grid.resources.num_workers"),
    ({"base": BASE, "points": [{"queue": "nope"}]}, "queue"),  # refused as POST /v1/jobs refuses it
    ({"base": BASE, "grid": {"lr": [1, 2]}, "count": 2}, "grid"),  # 4 members, over max_sweep_members (3)
]  # fmt: skip


def test_bad_requests_are_422_naming_the_field(db: Engine, tmp_path: Path) -> None:
    with live_api(db, tmp_path, api_tokens=TOKENS, max_sweep_members=3) as api:
        for body, field in BAD:
            r = call(api.url, "POST", "/v1/sweeps", json=body)
            assert (r.status_code, r.json().get("field")) == (422, field), (body, r.text)
        assert call(api.url, "GET", "/v1/sweeps").json()["items"] == []
        assert call(api.url, "GET", "/v1/jobs").json()["items"] == []  # all or nothing


def test_members_are_jobs_and_sweeps_are_their_owners(db: Engine, tmp_path: Path) -> None:
    body = {"base": BASE, "grid": {"lr": [0.1, 0.01], "resources.num_workers": [1, 2]}, "max_parallel": 1,
            "metric": {"name": "loss"}}  # fmt: skip
    with live_api(db, tmp_path, api_tokens=TOKENS) as api:
        r = call(api.url, "POST", "/v1/sweeps", json=body, headers={"Idempotency-Key": "k1"})
        assert r.status_code == 201, r.text
        sweep = r.json()
        assert r.headers["Location"] == f"/v1/sweeps/{sweep['id']}"
        assert (sweep["name"], sweep["size"], sweep["max_parallel"], sweep["counts"]) == ("mlp", 4, 1, {"QUEUED": 4})
        assert sweep["metric"] == {"name": "loss", "mode": "min"} and sweep["best"] is None and not sweep["done"]
        assert [m["values"] for m in sweep["members"]] == [
            {"lr": 0.1, "resources.num_workers": 1}, {"lr": 0.1, "resources.num_workers": 2},
            {"lr": 0.01, "resources.num_workers": 1}, {"lr": 0.01, "resources.num_workers": 2},
        ]  # fmt: skip
        listed = call(api.url, "GET", "/v1/jobs", params={"sweep": sweep["id"]}).json()["items"]
        assert sorted(j["id"] for j in listed) == sorted(m["job_id"] for m in sweep["members"])
        assert call(api.url, "GET", "/v1/jobs", "tok-bob", params={"sweep": sweep["id"]}).json()["items"] == []
        job = call(api.url, "GET", f"/v1/jobs/{sweep['members'][3]['job_id']}").json()
        assert (job["sweep_id"], job["sweep_index"], job["name"], job["owner"]) == (sweep["id"], 3, "mlp-3", "alice")
        assert job["spec"]["config"] == {"total_steps": 4, "lr": 0.01} and job["spec"]["resources"]["num_workers"] == 2

        replay = call(api.url, "POST", "/v1/sweeps", json=body, headers={"Idempotency-Key": "k1"})
        assert (replay.status_code, replay.json()["id"]) == (200, sweep["id"])
        other = call(api.url, "POST", "/v1/sweeps", json={**body, "max_parallel": 2}, headers={"Idempotency-Key": "k1"})
        assert other.status_code == 409

        path = f"/v1/sweeps/{sweep['id']}"
        assert call(api.url, "GET", path, "tok-bob").status_code == 404
        assert call(api.url, "POST", f"{path}/cancel", "tok-bob").status_code == 404
        assert call(api.url, "GET", "/v1/sweeps", "tok-bob").json()["items"] == []
        assert [s["id"] for s in call(api.url, "GET", "/v1/sweeps", "tok-root").json()["items"]] == [sweep["id"]]
        listed = call(api.url, "GET", "/v1/sweeps").json()["items"]
        assert [(s["id"], s["counts"]) for s in listed] == [(sweep["id"], {"QUEUED": 4})]
        assert call(api.url, "GET", "/v1/sweeps/nope").status_code == 404
        assert call(api.url, "GET", "/v1/sweeps", params={"cursor": "!!"}).json()["field"] == "cursor"

        r = call(api.url, "POST", f"{path}/cancel", "tok-root")  # an admin may cancel anyone's
        assert r.status_code == 202 and len(r.json()["cancelled"]) == 4
        after = call(api.url, "GET", path).json()
        assert after["counts"] == {"CANCELLED": 4} and after["done"] and after["cancelled_at"]
        assert {m["end_reason"] for m in after["members"]} == {"cancelled"}


def test_best_member_from_reported_metrics(db: Engine, tmp_path: Path) -> None:
    """Members admitted and reporting loss through the attempt API (as a job's train loop does): the sweep ranks
    them by the last loss each reported, and `best` is the lowest."""
    body = {"base": BASE, "grid": {"lr": [1, 2, 3]}, "metric": {"name": "loss", "mode": "min"}}
    losses = {0: [0.9, 0.4], 1: [0.7, 0.05, 0.2], 2: [0.3, 0.1]}  # last: 0.4, 0.2, 0.1
    with live_api(db, tmp_path, api_tokens=TOKENS) as api:
        sweep = call(api.url, "POST", "/v1/sweeps", json=body).json()
        assert len(_admit(db, api.settings, 8, NOW)) == 3
        for member in sweep["members"]:
            reporter = api.attempt_api(member["job_id"], 1)
            for step, loss in enumerate(losses[member["index"]], start=1):
                assert reporter.report({"loss": loss}, step=step)
        got = call(api.url, "GET", f"/v1/sweeps/{sweep['id']}").json()
        assert [(m["index"], m["metric"], m["best_metric"], m["rank"]) for m in got["members"]] == [
            (0, 0.4, 0.4, 3), (1, 0.2, 0.05, 2), (2, 0.1, 0.1, 1)]  # fmt: skip
        assert got["best"]["index"] == 2 and got["best"]["job_id"] == sweep["members"][2]["job_id"]


def test_cli_submit_status_cancel(db: Engine, tmp_path: Path) -> None:
    spec = tmp_path / "sweep.yaml"
    spec.write_text(yaml.safe_dump({"base": BASE, "grid": {"lr": [1, 2]}, "metric": {"name": "loss"}}))
    runner = CliRunner()
    with live_api(db, tmp_path, api_tokens=TOKENS) as api:
        common = ["--server", api.url, "--token", "tok-alice"]
        out = runner.invoke(cli, ["sweep", "submit", str(spec), *common, "--json"])
        assert out.exit_code == 0, out.output
        sweep = json.loads(out.stdout)
        _admit(db, api.settings, 8, NOW)
        for member, loss in zip(sweep["members"], [0.5, 0.25], strict=True):
            assert api.attempt_api(member["job_id"], 1).report({"loss": loss}, step=1)

        table = runner.invoke(cli, ["sweep", "status", sweep["id"], *common], env={"COLUMNS": "200"})
        assert table.exit_code == 0, table.output
        rows = [" ".join(line.replace("│", " ").split()) for line in table.stdout.splitlines()]
        ranked = [r for r in rows if r.split()[:1] in (["1"], ["2"])]
        first, second = sweep["members"][1]["job_id"], sweep["members"][0]["job_id"]
        assert ranked == [f"1 1 {first} STARTING 0.25 0.25 lr=2", f"2 0 {second} STARTING 0.5 0.5 lr=1"], rows
        assert f"best: member 1 ({first}) loss=0.25 lr=2" in rows

        plain = runner.invoke(cli, ["sweep", "submit", str(spec), *common])
        assert plain.exit_code == 0 and "submitted sweep s" in plain.stdout and "2 members" in plain.stdout
        listed = runner.invoke(cli, ["sweep", "list", *common, "--json"])
        assert len(json.loads(listed.stdout)["items"]) == 2

        cancelled = runner.invoke(cli, ["sweep", "cancel", sweep["id"], *common])
        assert cancelled.exit_code == 0 and "cancel requested for 2 members" in cancelled.stdout
        missing = runner.invoke(cli, ["sweep", "status", sweep["id"], "--server", api.url, "--token", "tok-bob"])
        assert missing.exit_code == 1 and "404" in missing.stderr
        bad = tmp_path / "bad.yaml"
        bad.write_text(yaml.safe_dump({"base": BASE, "grid": {"lr": []}}))
        refused = runner.invoke(cli, ["sweep", "submit", str(bad), *common])
        assert refused.exit_code == 1 and "grid.lr" in refused.stderr
