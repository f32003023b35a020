"""One exception root; each subclass carries the HTTP status and a stable code the API maps it to."""

from __future__ import annotations

from typing import Any


class ShunterError(Exception):
    status_code = 500
    code = "internal"

    def __init__(self, detail: str, *, field: str | None = None, extra: dict[str, Any] | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.field = field
        self.extra = extra or {}

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"detail": self.detail, "code": self.code}
        if self.field:
            body["field"] = self.field
        body.update(self.extra)
        return body


class NotFound(ShunterError):
    status_code = 404
    code = "not_found"


class Conflict(ShunterError):
    status_code = 409
    code = "conflict"


class InvalidSpec(ShunterError):
    status_code = 422
    code = "invalid_spec"


class Unauthorized(ShunterError):
    status_code = 401
    code = "unauthorized"


class Forbidden(ShunterError):
    status_code = 403
    code = "forbidden"


class IllegalTransition(ShunterError):
    """A state change the state table does not allow: a bug in the caller, never a user error."""

    status_code = 409
    code = "illegal_transition"


class StaleWrite(ShunterError):
    """The row moved on (another state, another lease) since it was read: the write was fenced off."""

    status_code = 409
    code = "stale"


class InfraError(ShunterError):
    status_code = 503
    code = "unavailable"
