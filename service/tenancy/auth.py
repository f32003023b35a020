"""Who is asking (`Caller`, from the API token's `service.config.tokens.TokenInfo`), and what a non-admin caller may
queue (issue 12)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from service.core.errors import Forbidden

if TYPE_CHECKING:
    from service.store.models import Job


@dataclass(frozen=True)
class Caller:
    """Who is asking: jobs are visible to their owner, and to admins."""

    owner: str = "anonymous"
    admin: bool = True
    team: str | None = None
    queues: tuple[str, ...] | None = None  # the queues a non-admin may submit to; None: any
    max_priority: int | None = None  # the highest priority a non-admin may ask for; None: any

    def may_see(self, job: Job) -> bool:
        return self.admin or job.owner == self.owner


def check_submit(caller: Caller, *, queue: str, priority: int) -> None:
    """A non-admin caller may queue a job (submit or retry) only in its own queues and up to its priority; 403."""
    if caller.admin:
        return
    if caller.queues is not None and queue not in caller.queues:
        allowed = ", ".join(caller.queues) or "none"
        raise Forbidden(f"queue: {caller.owner!r} may not use queue {queue!r}; allowed: {allowed}", field="queue")
    if caller.max_priority is not None and priority > caller.max_priority:
        raise Forbidden(
            f"priority: {priority} is above {caller.owner!r}'s maximum of {caller.max_priority}", field="priority"
        )
