"""The Ray Job for one attempt: `python -m workers.driver`, with where and how to report in its environment.

A job runs users' code, and its runtime_env shows in the Ray dashboard: it carries nothing of the service's (no
database URL, API token, progress secret or cloud key) nor the job's secrets (names or values), only a single-use
bootstrap credential (`service.tenancy.attempt_tokens`), which the driver trades for the attempt's token, and the API's
address, through which the job reads its spec and secrets and reports its progress.

Everything here reads the job's own input (its spec, its resume id); what is wrong there raises `InvalidSpec`
naming the field, and the dispatcher ends that job as a user error. Nothing here talks to Ray.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from sqlmodel import Session, select

from service.config.settings import Settings
from service.core.errors import InvalidSpec
from service.core.locations import STORE_LOCATION_ENV
from service.spec.job import JobSpec
from service.store.models import Attempt, Checkpoint, Job
from service.tenancy import attempt_tokens, code_proof, modes
from service.workflows import dependencies

ENTRYPOINT = "python -m workers.driver"


@dataclass(frozen=True)
class Submission:
    entrypoint: str
    runtime_env: dict[str, Any]
    metadata: dict[str, str]


def forwarded_environment() -> dict[str, str]:
    """Where the object store is, for jobs of a service that was told (never credentials: a Ray Job's runtime_env is
    shown in the dashboard; the cluster brings its own)."""
    return {name: os.environ[name] for name in STORE_LOCATION_ENV if os.environ.get(name)}


def resume_uri(session: Session, job: Job, spec: JobSpec) -> str | None:
    """An explicit `checkpoint.resume_from: <id>` names one of the job's own complete checkpoints."""
    number = spec.checkpoint.checkpoint_id
    if number is None:
        return None
    row = session.get(Checkpoint, number)
    if row is None or row.job_id != job.id or not row.complete:
        raise InvalidSpec(
            f"checkpoint.resume_from: job {job.id} has no complete checkpoint {number}", field="checkpoint.resume_from"
        )
    return row.uri


EXCLUDED_NODES_ENV = "SHUNTER_EXCLUDED_NODES"  # Ray node ids, comma-separated (workers.driver reads it)
CODE_DIGEST_ENV = "SHUNTER_CODE_DIGEST"  # what the working_dir archive unpacks to (workers.proof reads it)
CODE_URI_ENV = "SHUNTER_CODE_URI"
BOOTSTRAP_ENV = "SHUNTER_BOOTSTRAP"  # workers.context.exchange_bootstrap reads it


def build(
    session: Session, job: Job, spec: JobSpec, settings: Settings, *, attempt: Attempt | None = None
) -> Submission:
    """The attempt's entrypoint, runtime_env (the spec's, plus what the driver needs) and dashboard metadata.
    `attempt`: the attempt's row when the caller has it (else it is read)."""
    check_hand_off(session, job, spec, settings)
    runtime_env = json.loads(json.dumps(spec.runtime_env))
    # Reserved names are refused at submission; a spec stored before that rule must not set them either.
    env_vars = {k: v for k, v in runtime_env.get("env_vars", {}).items() if not modes.is_reserved(k)}
    for name, value in settings.job_env.items():
        env_vars.setdefault(name, str(value))
    cpus = spec.resources.per_worker().get("CPU", 1.0)
    # torchrun sets OMP_NUM_THREADS; Ray workers do not, and oversubscribed OpenMP threads slow steps a lot.
    env_vars.setdefault("OMP_NUM_THREADS", str(max(1, int(cpus))))
    env_vars.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", str(settings.train_poll_seconds))
    # Object-store settings the service was given reach the job too (the spec's env_vars win).
    for name, value in forwarded_environment().items():
        env_vars.setdefault(name, value)
    key = attempt_tokens.keys_for(session.get_bind(), settings).current
    env_vars.update(
        {
            "SHUNTER_JOB_ID": job.id,
            "SHUNTER_ATTEMPT": str(job.attempt),
            "SHUNTER_JOB_STORAGE": job_storage(spec, settings),
            "SHUNTER_PROGRESS_URL": progress_url(settings),
            # Not the attempt token: the dashboard shows this environment. The driver trades this for the token,
            # once (a copy is then worth nothing), and hands the token to the ranks as Ray task arguments.
            BOOTSTRAP_ENV: attempt_tokens.issue(job.id, job.attempt, key, prefix=attempt_tokens.BOOTSTRAP),
            # The size admission gave this attempt (an elastic job's is within its range).
            "SHUNTER_WORLD_SIZE": str(spec.resources.workers(job.world_size)),
        }
    )
    row = (
        attempt
        if attempt is not None and attempt.number == job.attempt
        else session.exec(select(Attempt).where(Attempt.job_id == job.id, Attempt.number == job.attempt)).first()
    )
    if row is not None and row.excluded_nodes:  # kept off by admission (service.policy.exclusion): Ray's placement too
        env_vars[EXCLUDED_NODES_ENV] = ",".join(row.excluded_nodes)
    resume = resume_uri(session, job, spec)
    if resume:
        env_vars["SHUNTER_RESUME_FROM"] = resume
    proof = code_proof.for_attempt(session, settings, spec)
    if proof is not None:
        # The driver and every train worker check the working directory against the archive's recorded files before
        # any of it runs (workers.proof). No bytecode is written into it: a `__pycache__` there is then always extra,
        # never a cache a process would load in place of the checked source.
        env_vars.update({CODE_DIGEST_ENV: proof.digest, CODE_URI_ENV: proof.uri, "PYTHONDONTWRITEBYTECODE": "1"})
    runtime_env["env_vars"] = env_vars
    metadata = {"shunter_job_id": job.id, "shunter_attempt": str(job.attempt), "name": job.name}
    return Submission(ENTRYPOINT, runtime_env, metadata)


def check_hand_off(session: Session, job: Job, spec: JobSpec, settings: Settings) -> None:
    """Every `${deps.<as>...}` reference in the config can be filled in (the driver reads the filled-in config from
    `driver_spec`); one that cannot names its field, and the job ends as a user error."""
    _, missing = dependencies.resolved_config(session, job, spec, storage_of=lambda s: job_storage(s, settings))
    if missing:
        path, _, ref = missing[0].partition(": ")
        raise InvalidSpec(f"{path}: {ref} has nothing to hand over: the dependency left no complete checkpoint",
                          field=path)  # fmt: skip


def driver_spec(session: Session, job: Job, settings: Settings) -> dict[str, Any]:
    """The stored spec as the job's driver gets it: with its config's dependency references filled in."""
    try:
        spec = JobSpec.model_validate(job.spec)
    except ValueError:
        return dict(job.spec)  # the dispatcher ends such a job; the driver learns nothing from a filled-in copy
    config, _ = dependencies.resolved_config(session, job, spec, storage_of=lambda s: job_storage(s, settings))
    return dict(job.spec) if config is spec.config else {**job.spec, "config": config}


def progress_url(settings: Settings) -> str:
    """How the job reaches the API: `SHUNTER_PUBLIC_URL`, else this process's own bind address (right for
    `shunter serve`, whose local Ray head runs on the same machine; a wildcard bind is reached on loopback)."""
    if settings.public_url:
        return settings.public_url.rstrip("/")
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "[::1]"}.get(settings.host, settings.host)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{settings.port}"


def job_storage(spec: JobSpec, settings: Settings) -> str:
    """Where the job's checkpoints (and its preemption notice) live."""
    return spec.checkpoint.storage or settings.absolute_storage_uri()
