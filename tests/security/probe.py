"""A hostile train loop: what a job can reach from inside Ray. It dumps its environment, tries to write another job's
progress and read its spec with its own attempt token, calls the user API with that token and with none, and tries
to read what the config names (the service's database file) and every process's environment. Wherever it reads, it
looks for `config["marker"]`, a string every secret of the test service contains. It prints one line,
`PROBE-RESULT <json>`, to its own log, which its owner reads back: that is the attacker's view."""

from __future__ import annotations

import glob
import json
import os
import pwd
from typing import Any


def _status(call: Any) -> int | str:
    try:
        return int(call().status_code)
    except Exception as exc:  # noqa: BLE001 - the attacker records whatever happens
        return type(exc).__name__


def _read(path: str) -> str:
    try:
        with open(path, "rb") as handle:
            return handle.read(1 << 20).decode(errors="replace")
    except OSError as exc:
        return f"<{type(exc).__name__}>"


def train_loop(config: dict[str, Any]) -> None:
    import httpx
    import ray.train

    env = dict(os.environ)
    url, token = env.get("SHUNTER_PROGRESS_URL", ""), env.get("SHUNTER_ATTEMPT_TOKEN", "")
    bearer = {"Authorization": f"Bearer {token}"}
    victim = config["victim"]
    internal = f"{url}/internal/v1/attempts/{victim}/1"
    result: dict[str, Any] = {
        "env": env,
        "user": pwd.getpwuid(os.getuid()).pw_name,  # who the train loop runs as
        "write_victim_progress": _status(lambda: httpx.post(f"{internal}/report", headers=bearer,
                                                            json={"metrics": {"loss": 666.0}, "step": 999})),
        "end_victim_attempt": _status(lambda: httpx.post(f"{internal}/end", headers=bearer,
                                                         json={"reason": "user_error", "message": "pwned"})),
        "read_victim_spec": _status(lambda: httpx.get(f"{internal}/spec", headers=bearer)),
        "user_api_with_attempt_token": _status(lambda: httpx.get(f"{url}/v1/jobs/{victim}", headers=bearer)),
        "user_api_without_token": _status(lambda: httpx.get(f"{url}/v1/jobs")),
        "files": {path: _read(path)[:200] for path in config.get("read", [])},
    }  # fmt: skip
    marker = config["marker"]
    readable = {p: _read(p) for p in glob.glob("/proc/[0-9]*/environ")}
    # Other processes' environments this user may read, and those that hold a secret of the service.
    result["proc_environ_readable"] = sorted(p for p, text in readable.items() if not text.startswith("<"))
    result["proc_environ_with_secret"] = sorted(p for p, text in readable.items() if marker in text)
    result["env_with_secret"] = sorted(k for k, v in env.items() if marker in v or marker in k)
    if ray.train.get_context().get_world_rank() == 0:
        print("PROBE-RESULT " + json.dumps(result), flush=True)
    ray.train.report({"step": 1, "loss": 0.0})


def result_of(log: str) -> dict[str, Any]:
    """The probe's findings, from its job's log."""
    line = next(line for line in log.splitlines() if "PROBE-RESULT " in line)
    return json.loads(line.split("PROBE-RESULT ", 1)[1])  # type: ignore[no-any-return]
