"""/v1/events: the timeline of every job the caller may see, as JSON history or a Server-Sent Events stream."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response

from api.deps import CallerDep, RuntimeDep, SessionDep
from api.schemas import ERROR_RESPONSES, EventPublic
from api.sse import SSE_RESPONSE, event_stream
from service.lifecycle import jobs

router = APIRouter(prefix="/v1/events", tags=["events"], responses=ERROR_RESPONSES)

After = Annotated[int, Query(ge=0, le=2**62, description="only events with a larger id")]
Follow = Annotated[bool, Query(description="stream as text/event-stream (Server-Sent Events)")]
# A header is text: the schema says so (digits, or empty for "from the start", as an EventSource that has seen no id
# sends it), rather than an integer-or-null no header can spell.
LastEventId = Annotated[
    str,
    Header(
        alias="Last-Event-ID",
        pattern=r"^[0-9]{0,18}$",
        description="resume a stream after this event id (an EventSource sends it when it reconnects)",
    ),
]
StreamTimeout = Annotated[
    float | None,
    Query(gt=0, le=86_400, description="with follow: end the stream after this many seconds (never after more "
                                       "than the server's stream_max_seconds)"),
]  # fmt: skip


def resume_after(after: int, last_event_id: str) -> int:
    return max(after, int(last_event_id) if last_event_id else 0)


@router.get("", response_model=list[EventPublic], responses=SSE_RESPONSE)
def all_events(
    request: Request,
    session: SessionDep,
    caller: CallerDep,
    runtime: RuntimeDep,
    after: After = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    follow: Follow = False,
    timeout_seconds: StreamTimeout = None,
    last_event_id: LastEventId = "",
) -> Response | list[EventPublic]:
    """Events of all jobs visible to the caller, oldest first. `follow=true` streams them as they happen, until
    `timeout_seconds` or the server's `stream_max_seconds`; at most `max_streams_per_caller` streams per caller."""
    start = resume_after(after, last_event_id)
    if follow:
        return event_stream(
            request.app, runtime.engine, runtime.settings, caller=caller, job_id=None, after=start,
            timeout_seconds=timeout_seconds,
        )  # fmt: skip
    rows = jobs.visible_events(session, caller=caller, after_id=start, limit=limit)
    return [EventPublic.model_validate(e) for e in rows]
