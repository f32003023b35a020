"""What a process inside a shunter Ray Job knows about its job: the spec, the job id and attempt.

The dispatcher puts these in the Ray Job's environment (`runtime_env.env_vars`), which Ray hands to the driver,
the Train controller and every train worker alike.
"""

from __future__ import annotations

import functools
import os

from service.spec import JobSpec

ENV_SPEC = "SHUNTER_JOB_SPEC"
ENV_JOB_ID = "SHUNTER_JOB_ID"
ENV_ATTEMPT = "SHUNTER_ATTEMPT"
ENV_DATABASE_URL = "SHUNTER_PROGRESS_DATABASE_URL"
ENV_STORAGE = "SHUNTER_JOB_STORAGE"


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
