"""What a process inside a shunter Ray Job knows about its job: the job id and attempt, and through them its spec.

The dispatcher puts the job id, the attempt, the storage, the API's address and a single-use bootstrap credential in
the Ray Job's environment (`runtime_env.env_vars`), which Ray hands to the driver, the Train controller and every
train worker alike, and shows in its dashboard. The driver trades the bootstrap for the attempt's token
(`exchange_bootstrap`) and hands the token on as Ray task arguments (the progress callback, the train loop's
arguments), never through that environment; each process then keeps it in its own (`adopt`), where the code below and
a script's subprocesses find it. The spec itself is read once per process from the API (no size limit, and not shown
in the Ray dashboard), and so are the job's secrets, by each rank before the job's code runs (`load_secrets`).
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from workers.attempt_api import AttemptApi

if TYPE_CHECKING:  # imported where used: the Train controller reads the constants below, never a spec
    from service.spec.job import JobSpec, Resources

ENV_JOB_ID = "SHUNTER_JOB_ID"
ENV_ATTEMPT = "SHUNTER_ATTEMPT"
ENV_STORAGE = "SHUNTER_JOB_STORAGE"
ENV_PROGRESS_URL = "SHUNTER_PROGRESS_URL"  # the shunter API the job reports to
ENV_ATTEMPT_TOKEN = "SHUNTER_ATTEMPT_TOKEN"  # good only for this attempt's rows (service.tenancy.attempt_tokens)
ENV_BOOTSTRAP = "SHUNTER_BOOTSTRAP"  # good once, for the attempt token (service.dispatch.submission)
ENV_WORLD_SIZE = "SHUNTER_WORLD_SIZE"  # the workers admission gave this attempt
# A reserved metric key: every report made through a `Prepared` (workers.strategies.prepare) names the strategy it
# applied, so the Train callback can tell a loop that applied the spec's strategy from plain Ray Train code.
STRATEGY_METRIC = "_shunter_strategy"
# A reserved metric key: the report every rank makes once its train loop has returned (`workers.progress.
# announce_finished`). Ray Train hands it to the controller's callback after every report the loop made, so the
# callback can record the attempt's success there, before Ray Train's teardown, which can take seconds.
FINISHED_METRIC = "_shunter_finished"


@functools.lru_cache
def job_spec() -> JobSpec:
    """The spec of the job this process belongs to, read once from the API (a default DDP spec outside shunter, for
    plain Ray Train use)."""
    from service.spec.job import JobSpec

    api = attempt_api()
    if api is None:
        return JobSpec.model_validate({"entrypoint": {"callable": "unknown:unknown"}})
    return JobSpec.model_validate(api.spec())


def attempt_api() -> AttemptApi | None:
    """How this attempt reaches shunter; None outside a shunter job."""
    url, token, job = os.environ.get(ENV_PROGRESS_URL), os.environ.get(ENV_ATTEMPT_TOKEN), job_id()
    if not (url and token and job):
        return None
    return AttemptApi(url=url, token=token, job_id=job, attempt=attempt())


def exchange_bootstrap() -> None:
    """In the driver, before anything else asks the API: the attempt token for the bootstrap credential, kept in this
    process's environment; the bootstrap leaves it. Raises AttemptApiError when the API refuses (a bootstrap used by
    another, or an attempt already over): the attempt cannot report, so it must not train."""
    import secrets

    url, bootstrap, job = os.environ.get(ENV_PROGRESS_URL), os.environ.pop(ENV_BOOTSTRAP, None), job_id()
    if not (url and bootstrap and job) or os.environ.get(ENV_ATTEMPT_TOKEN):
        return
    nonce = secrets.token_urlsafe(32)  # this driver's alone: its retries are not a copy's use
    adopt(AttemptApi(url=url, token=bootstrap, job_id=job, attempt=attempt()).bootstrap(nonce))


def credential() -> str | None:
    """The attempt token this process holds, to hand to the ranks as a task argument."""
    return os.environ.get(ENV_ATTEMPT_TOKEN)


def adopt(token: str | None) -> None:
    """Keep the attempt token where this process's reporting and a script's subprocesses look for it."""
    if token:
        os.environ[ENV_ATTEMPT_TOKEN] = token
    os.environ.pop(ENV_BOOTSTRAP, None)  # used by the driver: no use to anyone here


def load_secrets() -> list[str]:
    """Set the job's secrets in this process's environment (a rank's, before the job's code runs); their names."""
    api = attempt_api()
    if api is None or not job_spec().secrets:
        return []
    values = api.secrets()
    os.environ.update(values)
    return sorted(values)


def world_size(res: Resources) -> int:
    """The workers this attempt runs: what admission gave it (an elastic job's size within its range), else the
    spec's number (its max for a range)."""
    given = os.environ.get(ENV_WORLD_SIZE, "")
    return res.workers(int(given) if given.isdigit() else None)


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
