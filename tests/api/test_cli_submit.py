"""Issue 38, item 4: `shunter submit --dry-run` (the server's `POST /v1/jobs/validate`), `--env` and `--set`.

The CLI runs as a real process against a live API over a real SQLite file (tests/live_api.py); the endpoint itself
also through the app, where what it must not write is counted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from sqlmodel import Session, func, select

from service.store.db import make_engine
from service.store.migrate import upgrade
from service.store.models import Job, JobEvent
from tests.api.conftest import GOOD
from tests.live_api import live_api

REPO = Path(__file__).resolve().parents[2]


def cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "api.cli", *args, "--server", url], capture_output=True, text=True,
                          timeout=120, cwd=REPO)  # fmt: skip


def test_dry_run_env_and_set_through_the_cli(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'api.db'}")
    upgrade(engine)
    spec = tmp_path / "job.yaml"
    spec.write_text(json.dumps(GOOD))
    with live_api(engine, tmp_path) as api:
        ok = cli(api.url, "submit", str(spec), "--dry-run", "--set", "resources.num_workers=3", "--env", "FOO=b=r")
        assert ok.returncode == 0 and "valid" in ok.stdout and "nothing was" in ok.stdout, ok.stderr
        said = cli(api.url, "submit", str(spec), "--dry-run", "--json", "--set", "priority=7")
        assert said.returncode == 0 and json.loads(said.stdout)["spec"]["priority"] == 7, said.stderr
        refused = cli(api.url, "submit", str(spec), "--dry-run", "--set", "resources.num_workers=0")
        assert refused.returncode != 0 and "resources.num_workers" in refused.stderr, refused.stderr
        bad = cli(api.url, "submit", str(spec), "--set", "resources..x=1")
        assert bad.returncode == 2 and "expected a.b.c=value" in bad.stderr
        with Session(engine) as session:
            assert session.exec(select(func.count()).select_from(Job)).one() == 0  # the dry runs queued nothing
        real = cli(api.url, "submit", str(spec), "--json", "--env", "FOO=b=r", "--set", "resources.num_workers=3",
                   "--set", "config.lr=0.5")  # fmt: skip
        assert real.returncode == 0, real.stderr
        job = json.loads(real.stdout)
        assert job["spec"]["runtime_env"]["env_vars"] == {"FOO": "b=r"}
        assert job["spec"]["resources"]["num_workers"] == 3 and job["spec"]["config"]["lr"] == 0.5
    engine.dispose()


def test_validate_answers_as_a_submission_would_and_writes_nothing(app_client) -> None:
    c = app_client()
    engine = c.app.state.runtime.engine
    ok = c.post("/v1/jobs/validate", json=GOOD)
    assert ok.status_code == 200 and ok.json()["valid"] is True and ok.json()["spec"] == GOOD, ok.text
    for body, field in (({**GOOD, "queue": "nope"}, "queue"), ({**GOOD, "retries": {"max_attempts": 0}},
                                                                 "retries.max_attempts")):  # fmt: skip
        said, real = c.post("/v1/jobs/validate", json=body), c.post("/v1/jobs", json=body)
        assert said.status_code == real.status_code == 422 and said.json()["field"] == real.json()["field"] == field
    with Session(engine) as session:
        assert session.exec(select(func.count()).select_from(Job)).one() == 0
        assert session.exec(select(func.count()).select_from(JobEvent)).one() == 0
    warned = c.post("/v1/jobs/validate", json={**GOOD, "resources": {"num_workers": 1, "accelerator_type": "H1OO"}})
    assert warned.status_code == 200 and "not one of Ray's accelerator names" in warned.json()["warnings"][0]


def test_profiles_completion_and_list_filters_with_paging(tmp_path: Path) -> None:
    """Profiles give the server and token, below the flags and SHUNTER_URL / SHUNTER_TOKEN; a profile file others
    can read is refused; completion scripts print for bash, zsh and fish; `list` takes the API's filters and pages."""
    import os
    import stat

    from service.backends.ray_local import free_port
    from tests.api.conftest import TOKENS

    engine = make_engine(f"sqlite:///{tmp_path / 'api.db'}")
    upgrade(engine)
    home = tmp_path / "home"
    config = home / "shunter" / "config.toml"
    config.parent.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHUNTER_")} | {"XDG_CONFIG_HOME": str(home)}

    def run(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "api.cli", *args], capture_output=True, text=True, timeout=120,
                              cwd=REPO, env=env | extra)  # fmt: skip

    with live_api(engine, tmp_path, api_tokens=TOKENS) as api:
        config.write_text(f'default = "dev"\n[profiles.dev]\nserver = "{api.url}"\ntoken = "tok-alice"\n'
                          f'[profiles.root]\nserver = "{api.url}"\ntoken = "tok-root"\n')  # fmt: skip
        config.chmod(0o644)
        loose = run("list")
        assert loose.returncode == 2 and "others can read it" in loose.stderr and "chmod 600" in loose.stderr
        config.chmod(stat.S_IRUSR | stat.S_IWUSR)
        spec = tmp_path / "job.yaml"
        spec.write_text(json.dumps(GOOD))
        for name in ("a", "b", "c"):
            assert run("submit", str(spec), "--set", f"name={name}").returncode == 0  # the default profile: alice
        assert run("--profile", "root", "submit", str(spec), "--set", "name=r").returncode == 0
        mine = json.loads(run("list", "--json").stdout)
        assert {j["name"] for j in mine["items"]} == {"a", "b", "c"}  # alice sees hers only
        everyone = json.loads(run("list", "--json", SHUNTER_PROFILE="root").stdout)
        assert len(everyone["items"]) == 4
        page = run("--profile", "root", "list", "--limit", "2")
        assert page.returncode == 0 and "more: --cursor" in page.stdout
        cursor = page.stdout.split("more: --cursor")[1].split()[0]
        rest = json.loads(run("--profile", "root", "list", "--json", "--limit", "2", "--cursor", cursor).stdout)
        assert len(rest["items"]) == 2 and rest["next_cursor"] is None
        named = json.loads(run("--profile", "root", "list", "--json", "--name", "b", "--owner", "alice").stdout)
        assert [j["name"] for j in named["items"]] == ["b"]
        # SHUNTER_URL and SHUNTER_TOKEN come before the profile, and the flags before them.
        dead = f"http://127.0.0.1:{free_port()}"
        assert run("list", SHUNTER_URL=dead).returncode == 2
        assert run("list", "--server", api.url, SHUNTER_URL=dead).returncode == 0
        assert run("list", SHUNTER_TOKEN="not-a-token").returncode == 1  # 401: the profile's token was not used
        assert "not in" in run("--profile", "nope", "list").stderr
    engine.dispose()
    # The shell is named here: typer otherwise detects it from the parent process, which is `sh` under make/CI.
    for shell in ("bash", "zsh", "fish"):
        shown = run("--show-completion", shell, _TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION="1")
        assert shown.returncode == 0 and "complete" in shown.stdout.lower(), (shell, shown.stderr)
