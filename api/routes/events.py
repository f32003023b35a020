"""/v1/events: the timeline of every job the caller may see, as JSON history or a Server-Sent Events stream."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, Response

from api.deps import CallerDep, RuntimeDep, SessionDep
from api.schemas import ERROR_RESPONSES, EventPublic
from api.sse import SSE_RESPONSE, event_stream
from service import jobs

router = APIRouter(prefix="/v1/events", tags=["events"], responses=ERROR_RESPONSES)

After = Annotated[int, Query(ge=0, le=2**62, description="only events with a larger id")]
Follow = Annotated[bool, Query(description="stream as text/event-stream (Server-Sent Events)")]
LastEventId = Annotated[
    int | None, Header(alias="Last-Event-ID", ge=0, le=2**62, description="resume a stream after this event id")
]
StreamTimeout = Annotated[
    float | None, Query(gt=0, le=86_400, description="with follow: end the stream after this many seconds")
]


@router.get("", response_model=list[EventPublic], responses=SSE_RESPONSE)
def all_events(
    session: SessionDep,
    caller: CallerDep,
    runtime: RuntimeDep,
    after: After = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    follow: Follow = False,
    timeout_seconds: StreamTimeout = None,
    last_event_id: LastEventId = None,
) -> Response | list[EventPublic]:
    """Events of all jobs visible to the caller, oldest first. `follow=true` streams them as they happen."""
    start = max(after, last_event_id or 0)
    if follow:
        return event_stream(runtime.engine, caller=caller, job_id=None, after=start, timeout_seconds=timeout_seconds)
    rows = jobs.visible_events(session, caller=caller, after_id=start, limit=limit)
    return [EventPublic.model_validate(e) for e in rows]
