"""Dependencies the routes share: the runtime, a session per request, the caller."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Header, Request
from sqlmodel import Session

from service.config.settings import Settings
from service.core.errors import Unauthorized
from service.runtime import Runtime
from service.store.db import write_bind
from service.tenancy.auth import Caller


# The dependencies that only read what the request or the app holds are `async`: FastAPI runs a plain `def` one in
# its threadpool, a thread hop each per request (a third of a submission's time on 2 cores went to such hops).
async def get_runtime(request: Request) -> Runtime:
    return request.app.state.runtime


async def get_settings_dep(request: Request) -> Settings:
    return request.app.state.runtime.settings


async def get_session(request: Request, runtime: Annotated[Runtime, Depends(get_runtime)]) -> AsyncIterator[Session]:
    """A session per request; requests that change state get a write transaction from their first statement.

    Used with `scope="function"` (SessionDep): the session is committed and closed, and its pooled connection given
    back, as soon as the route has returned, before the response is sent. A follow stream therefore holds no
    connection while it streams (it opens a short session per poll); with FastAPI's default ("request") scope the
    session would stay open until the last byte of a StreamingResponse, hours for a follow.

    Opening the session does no I/O (its transaction begins at the route's first statement, in the route's thread:
    `write_bind`), and a route that committed leaves nothing to do after it: only a transaction still open is
    committed (or rolled back) here, off the event loop."""
    write = request.method not in ("GET", "HEAD", "OPTIONS")
    session = Session(write_bind(runtime.engine) if write else runtime.engine, expire_on_commit=False)
    try:
        yield session
        if session.in_transaction():
            await asyncio.to_thread(session.commit)
    except BaseException:
        if session.in_transaction():
            await asyncio.to_thread(session.rollback)
        raise
    finally:
        session.close()


async def get_caller(
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
