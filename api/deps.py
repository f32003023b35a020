"""Dependencies the routes share: the runtime, a session per request, the caller."""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Header, Request
from sqlmodel import Session

from service.db import session_scope
from service.errors import Unauthorized
from service.jobs import Caller
from service.runtime import Runtime
from service.settings import Settings


def get_runtime(request: Request) -> Runtime:
    return request.app.state.runtime  # type: ignore[no-any-return]


def get_settings_dep(request: Request) -> Settings:
    return request.app.state.runtime.settings  # type: ignore[no-any-return]


def get_session(request: Request, runtime: Annotated[Runtime, Depends(get_runtime)]) -> Iterator[Session]:
    """A session per request; requests that change state get a write transaction from the start.

    Used with `scope="function"` (SessionDep): the session is committed and closed, and its pooled connection given
    back, as soon as the route has returned, before the response is sent. A follow stream therefore holds no
    connection while it streams (it opens a short session per poll); with FastAPI's default ("request") scope the
    session would stay open until the last byte of a StreamingResponse, hours for a follow."""
    with session_scope(runtime.engine, write=request.method not in ("GET", "HEAD", "OPTIONS")) as session:
        yield session


def get_caller(
    settings: Annotated[Settings, Depends(get_settings_dep)],
    authorization: Annotated[str | None, Header()] = None,
) -> Caller:
    """Without configured tokens everyone is an admin (loopback use); with them a valid Bearer token is required,
    and the caller is what its `TokenInfo` grants."""
    tokens = settings.api_tokens
    if not tokens:
        return Caller(owner="anonymous", admin=True)
    scheme, _, presented = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not presented:
        raise Unauthorized("missing 'Authorization: Bearer <token>' header")
    match = None
    # Compare against every token in constant time, so timing tells nothing about how close a guess was.
    for token, info in tokens.items():
        if hmac.compare_digest(token.encode(), presented.encode()):
            match = info
    if match is None:
        raise Unauthorized("unknown token")
    queues = tuple(match.queues) if match.queues is not None else None
    return Caller(owner=match.owner, admin=match.admin, team=match.team, queues=queues, max_priority=match.max_priority)


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
CallerDep = Annotated[Caller, Depends(get_caller)]
SettingsDep = Annotated[Settings, Depends(get_settings_dep)]
