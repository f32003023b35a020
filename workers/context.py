"""What a process inside a shunter Ray Job knows about its job: the spec, the job id and attempt.

The dispatcher puts these in the Ray Job's environment (`runtime_env.env_vars`), which Ray hands to the driver,
the Train controller and every train worker alike.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

from service.spec import JobSpec

ENV_SPEC = "SHUNTER_JOB_SPEC"
ENV_JOB_ID = "SHUNTER_JOB_ID"
ENV_ATTEMPT = "SHUNTER_ATTEMPT"
ENV_DATABASE_URL = "SHUNTER_PROGRESS_DATABASE_URL"
ENV_STORAGE = "SHUNTER_JOB_STORAGE"
# A reserved metric key: every report made through a `Prepared` (workers.strategies.prepare) names the strategy it
# applied, so the Train callback can tell a loop that applied the spec's strategy from plain Ray Train code.
STRATEGY_METRIC = "_shunter_strategy"


@functools.lru_cache
def job_spec() -> JobSpec:
    """The spec of the job this process belongs to (a default DDP spec outside shunter, for plain Ray Train use)."""
    raw = os.environ.get(ENV_SPEC)
    if not raw:
        return JobSpec.model_validate({"entrypoint": {"callable": "unknown:unknown"}})
    return JobSpec.model_validate_json(raw)


def job_id() -> str | None:
    return os.environ.get(ENV_JOB_ID)


def attempt() -> int:
    return int(os.environ.get(ENV_ATTEMPT, "1"))


def locate(path: str, *, field: str) -> Path:
    """A file a spec names: as given (absolute, or from the working dir, which is the job's `working_dir`), else found
    under an import root (a local head started by `shunter serve` has the checkout on PYTHONPATH)."""
    candidate = Path(path)
    if candidate.is_absolute() or candidate.exists():
        return candidate.resolve()
    for root in sys.path:
        found = Path(root or ".") / path
        if found.exists():
            return found.resolve()
    raise FileNotFoundError(f"{field}: {path} not found (working dir {os.getcwd()})")
