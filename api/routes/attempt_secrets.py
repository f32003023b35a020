"""/internal/v1/attempts: how a running attempt gets its credential and its secrets (issue 38).

- `POST .../bootstrap` trades the attempt's bootstrap credential (the one thing the Ray Job's runtime_env carries,
  which the Ray dashboard shows) for the attempt token. It is good once: the first driver to send it, with a nonce of
  its own, gets the token, and gets it again on a retry with the same nonce (an answer lost to a restarting API);
  anyone else, a copy of it taken from Ray's job record, is refused (403). So is any use once the attempt has ended
  or its job moved on (409).
- `GET .../secrets` gives a rank the values of the secrets its job's spec names (`service.tenancy.secret_store`),
  with the attempt token, while the job is on that attempt. Nothing else answers with a value.
"""

from __future__ import annotations

import hashlib
from typing import Annotated

from fastapi import APIRouter, Header, Response
from pydantic import BaseModel, Field
from sqlalchemy import update
from sqlmodel import Session, col

from api.deps import RuntimeDep, SettingsDep
from api.routes.internal import PREFIX, AttemptNo, JobId, Scope, _Body, on_attempt
from api.schemas import ERROR_RESPONSES
from service.core.errors import Forbidden, Unauthorized
from service.store.db import session_scope
from service.store.models import Attempt
from service.tenancy import attempt_tokens, secret_store

router = APIRouter(prefix=PREFIX, tags=["internal"], responses=ERROR_RESPONSES)
NO_STORE = {"Cache-Control": "no-store"}


class BootstrapBody(_Body):
    nonce: str = Field(min_length=32, max_length=128, pattern=r"^[A-Za-z0-9_-]+$",
                       description="the driver's own random value: its retries are told from a copy's use")  # fmt: skip


class Credential(BaseModel):
    token: str


class Secrets(BaseModel):
    secrets: dict[str, str]


@router.post("/{job_id}/{attempt}/bootstrap", response_model=Credential)
def bootstrap(
    job_id: JobId,
    attempt: AttemptNo,
    body: BootstrapBody,
    response: Response,
    rt: RuntimeDep,
    settings: SettingsDep,
    authorization: Annotated[str | None, Header()] = None,
) -> Credential:
    scheme, _, presented = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not presented:
        raise Unauthorized("missing 'Authorization: Bearer <bootstrap credential>' header")
    keys = attempt_tokens.keys_for(rt.engine, settings)
    try:
        named = attempt_tokens.verify(presented.strip(), keys.accepted, prefix=attempt_tokens.BOOTSTRAP)
    except attempt_tokens.InvalidToken as exc:
        raise Unauthorized("not a valid bootstrap credential") from exc
    if named != (job_id, attempt):
        raise Forbidden("this bootstrap credential is for another job or attempt")
    nonce = hashlib.sha256(body.nonce.encode()).hexdigest()
    with session_scope(rt.engine) as session:
        owner = on_attempt(session, job_id, attempt).owner
        taken = session.execute(
            update(Attempt)
            .where(col(Attempt.job_id) == job_id, col(Attempt.number) == attempt, col(Attempt.ended_at).is_(None))
            .where(col(Attempt.bootstrap_nonce).is_(None) | (col(Attempt.bootstrap_nonce) == nonce))
            .values(bootstrap_nonce=nonce)
        ).rowcount  # type: ignore[attr-defined]  # an UPDATE's result is a CursorResult; Session.execute says Result
    if not taken:
        raise Forbidden(f"the bootstrap credential of attempt {attempt} of job {job_id} was used already")
    response.headers.update(NO_STORE)
    return Credential(token=attempt_tokens.issue(job_id, attempt, keys.current, owner=owner))


@router.get("/{job_id}/{attempt}/secrets", response_model=Secrets)
def secrets(scope: Scope, response: Response, rt: RuntimeDep, settings: SettingsDep) -> Secrets:
    """The values of the secrets the job's spec names, by name (422 naming one no longer kept)."""
    job_id, attempt = scope
    with Session(rt.engine) as session:
        job = on_attempt(session, job_id, attempt)
        values = secret_store.values_for(session, settings, job)
    response.headers.update(NO_STORE)
    return Secrets(secrets=values)
