"""Issue 38, item 5: the operator's settings in a YAML file (`SHUNTER_CONFIG`), the environment over it, and
`shunter config check` naming the key of each mistake. The file read by a real `shunter api` process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from service.backends.ray_local import free_port
from service.config import policies
from service.config.settings import Settings
from tests.conftest import wait_for

REPO = Path(__file__).resolve().parents[2]
GOOD = """\
queues:
  research: {max_running: 2, accelerator_types: [A100]}
quotas:
  owner: {alice: {max_cpus: 8}}
fair_share: {half_life_hours: 12, owner_weights: {alice: 2}}
webhooks: []
port: 9000
"""


def check(path: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHUNTER_")}
    return subprocess.run([sys.executable, "-m", "api.cli", "config", "check", str(path)], capture_output=True,
                          text=True, timeout=120, cwd=REPO, env=env)  # fmt: skip


def test_the_file_is_read_below_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "shunter.yaml"
    path.write_text(GOOD)
    monkeypatch.setenv("SHUNTER_CONFIG", str(path))
    monkeypatch.setenv("SHUNTER_PORT", "9100")
    settings = Settings()
    assert settings.queues == {"research": {"max_running": 2, "accelerator_types": ["A100"]}}
    assert policies.fair_share(settings).owner_weight("alice") == 2 and policies.quota_rules(settings) is not None
    assert settings.port == 9100  # the environment wins
    assert Settings(port=9200).port == 9200  # and arguments over both


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("queuez: {}\n", "unknown settings ['queuez']"),
        ("queues:\n  research: {max_running: -1}\n", "queues.research.max_running"),
        ("port: seventy\n", "port:"),
        ("quotas:\n  owner: {alice: {max_cpus: lots}}\n", "quotas"),
        ("node_types:\n  t4: {resources: {CPU: 1}}\n", "node_types.t4.max"),
        ("queues: [\n", "while parsing"),  # not YAML
    ],
)
def test_config_check_names_the_key_of_each_mistake(tmp_path: Path, text: str, named: str) -> None:
    path = tmp_path / "shunter.yaml"
    path.write_text(text)
    out = check(path)
    assert out.returncode == 1 and named in out.stderr, out.stderr


def test_config_check_passes_a_good_file_and_the_api_serves_what_it_says(tmp_path: Path) -> None:
    path = tmp_path / "shunter.yaml"
    path.write_text(GOOD)
    ok = check(path)
    assert ok.returncode == 0 and "ok" in ok.stdout, ok.stderr
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHUNTER_")} | {
        "SHUNTER_CONFIG": str(path), "SHUNTER_PORT": str(port), "SHUNTER_DATA_DIR": str(tmp_path / "data"),
        "SHUNTER_DATABASE_URL": f"sqlite:///{tmp_path / 'api.db'}", "SHUNTER_BACKEND": f"noop:{tmp_path / 'noop'}",
        "SHUNTER_STORAGE_URI": str(tmp_path / "ckpt"),
    }  # fmt: skip
    log = open(tmp_path / "api.log", "wb")  # noqa: SIM115 - the child writes it
    proc = subprocess.Popen([sys.executable, "-m", "api.cli", "api"], env=env, cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT)  # fmt: skip
    try:

        def queues() -> list | None:
            assert proc.poll() is None, (tmp_path / "api.log").read_text()[-3000:]
            try:
                return httpx.get(f"http://127.0.0.1:{port}/v1/queues", timeout=2).json()
            except httpx.HTTPError:
                return None

        listed = {q["name"]: q for q in wait_for(queues, timeout=60, what="shunter api")}
        assert listed["research"]["limits"]["max_running"] == 2
        assert listed["research"]["limits"]["accelerator_types"] == ["A100"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
