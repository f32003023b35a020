"""/v1/secrets: values a job's `secrets:` names, kept encrypted; written and listed, never read back (issue 38).

`PUT /v1/secrets/{name}` keeps the caller's own (scope `owner`, the default). An admin may keep a team's
(`?scope=team&team=<team>`) or the cluster's (`?scope=cluster`), and another owner's (`?owner=`). A job gets its
owner's secret of a name, else its team's, else the cluster's. `GET /v1/secrets` lists the names the caller may use;
no answer anywhere holds a value (see `service.tenancy.secret_store`).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Response, status
from pydantic import BaseModel, ConfigDict, Field

from api.deps import CallerDep, SessionDep, SettingsDep
from api.schemas import ERROR_RESPONSES, SecretInfo
from service.core.errors import Forbidden
from service.spec.secret_names import MAX_VALUE_CHARS, NAME_PATTERN
from service.store.models import Secret
from service.tenancy.auth import Caller
from service.tenancy.secret_store import Scope, delete, put, visible

router = APIRouter(prefix="/v1/secrets", tags=["secrets"], responses=ERROR_RESPONSES)
Name = Annotated[str, Path(pattern=NAME_PATTERN, description="an environment variable's name, not SHUNTER_* or RAY_*")]
ScopeQuery = Annotated[Scope, Query(description="owner (the caller's own), team or cluster (admins)")]
HolderQuery = Annotated[str | None, Query(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._@-]+$")]


class SecretValue(BaseModel):
    model_config = ConfigDict(extra="forbid")
    value: str = Field(min_length=1, max_length=MAX_VALUE_CHARS, description="kept encrypted; never answered back")


def _info(row: Secret) -> SecretInfo:
    scope = Scope(row.scope)
    return SecretInfo(name=row.name, scope=scope.value, owner=row.holder if scope is Scope.owner else None,
                      team=row.holder if scope is Scope.team else None, updated_at=row.updated_at,
                      updated_by=row.updated_by)  # fmt: skip


def _holder(caller: Caller, scope: Scope, owner: str | None, team: str | None) -> str:
    """Whose secret the request names; a non-admin names only its own (403)."""
    if scope is Scope.owner:
        if owner is not None and owner != caller.owner and not caller.admin:
            raise Forbidden("owner: only an admin keeps another owner's secrets", field="owner")
        return owner or caller.owner
    if not caller.admin:
        raise Forbidden(f"scope: only an admin keeps {scope.value} secrets", field="scope")
    if scope is Scope.team:
        if not (team or caller.team):
            raise Forbidden("team: you belong to no team; name one (?team=)", field="team")
        return team or caller.team or ""
    return ""


@router.put("/{name}", response_model=SecretInfo)
def put_secret(
    name: Name, body: SecretValue, session: SessionDep, caller: CallerDep, settings: SettingsDep,
    scope: ScopeQuery = Scope.owner, owner: HolderQuery = None, team: HolderQuery = None,
) -> SecretInfo:  # fmt: skip
    """Keep a secret's value (replacing the one kept under its name). The answer names it; it never holds the value."""
    holder = _holder(caller, scope, owner, team)
    row = put(session, settings, scope=scope, holder=holder, name=name, value=body.value, by=caller.owner)
    info = _info(row)
    session.commit()
    return info


@router.get("", response_model=list[SecretInfo])
def list_secrets(session: SessionDep, caller: CallerDep) -> list[SecretInfo]:
    """The secrets the caller's jobs may name (an admin: every one), by name: never a value."""
    return [_info(r) for r in visible(session, owner=caller.owner, team=caller.team, admin=caller.admin)]


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT, response_class=Response)
def delete_secret(name: Name, session: SessionDep, caller: CallerDep, scope: ScopeQuery = Scope.owner,
                  owner: HolderQuery = None, team: HolderQuery = None) -> Response:  # fmt: skip
    """Forget a secret. A job that names it and has not started yet then fails its attempt (user error)."""
    delete(session, scope=scope, holder=_holder(caller, scope, owner, team), name=name)
    session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)
