"""What a spec's `notify` entries and the cluster's `SHUNTER_WEBHOOKS` may say (issue 18, notifications).

Pure pydantic, no database and no network: workers import the job spec, and this with it. A URL is checked here for
form only (http or https, a host, no credentials, a bounded length); whether its host is a private address is
decided where it can be known: at submission for an address written out (`service.workflows.notifications.check_spec`),
and for a name at every delivery, on the address it resolves to (`service.workflows.webhooks`).
"""

from __future__ import annotations

from enum import Enum
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from service.core.numbers import StrictModel

MAX_URL_LENGTH = 2048
MAX_TARGETS = 10
MIN_SECRET_LENGTH = 16
MAX_SECRET_LENGTH = 256
# The names of `service.store.models.JobState` (not imported: the spec stays free of the database layer; a test checks
# that the two agree). Without `events`, an entry hears of the job's end only: the states a person waits for.
STATE_NAMES = ("QUEUED", "STARTING", "RUNNING", "CANCELLING", "SUCCEEDED", "FAILED", "CANCELLED")
DEFAULT_EVENTS = ("SUCCEEDED", "FAILED", "CANCELLED")


class PayloadFormat(str, Enum):
    json = "json"  # the event as shunter's JSON document (service.policy.webhook_rules.event_document)
    slack = "slack"  # {"text": "..."}: what Slack (and Mattermost, Discord's /slack) incoming webhooks take


def check_url(value: str) -> str:
    """The URL itself, if it is an absolute http(s) URL with a host and no user:password; else ValueError."""
    if len(value) > MAX_URL_LENGTH:
        raise ValueError(f"must be at most {MAX_URL_LENGTH} characters")
    if any(ch.isspace() or ord(ch) < 0x20 for ch in value):
        raise ValueError("must not contain whitespace or control characters")
    try:
        parts = urlsplit(value)
        port = parts.port  # a port that is not a number in range raises here
    except ValueError as exc:
        raise ValueError(f"is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"must be an http:// or https:// URL, got scheme {parts.scheme!r}")
    if not parts.hostname:
        raise ValueError("must name a host")
    if parts.username is not None or parts.password is not None:
        raise ValueError("must not carry credentials (user:password@); sign with a secret instead")
    if port == 0:
        raise ValueError("must not use port 0")
    return value


class Delivery(StrictModel):
    """Fields a job's entry and a cluster target share."""

    url: str = Field(description="http(s) URL the events are POSTed to")
    events: list[str] = Field(
        default_factory=lambda: list(DEFAULT_EVENTS), min_length=1, max_length=len(STATE_NAMES),
        description="the states whose entry is sent (default: SUCCEEDED, FAILED, CANCELLED)",
    )  # fmt: skip
    format: PayloadFormat = PayloadFormat.json

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        return check_url(value)

    @field_validator("events")
    @classmethod
    def _states(cls, value: list[str]) -> list[str]:
        unknown = [v for v in value if v not in STATE_NAMES]
        if unknown:
            raise ValueError(f"unknown states {unknown}; known: {list(STATE_NAMES)}")
        if len(set(value)) != len(value):
            raise ValueError("lists a state twice")
        return value


def check_secret(value: str | None) -> str | None:
    """A secret is text without control characters (PostgreSQL text cannot even hold a NUL: it would be kept as
    another character, and no signature would match)."""
    if value is not None and any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in value):
        raise ValueError("must not contain control characters")
    return value


class NotifyTarget(Delivery):
    """One `notify` entry of a job spec. Its `secret` signs the job's deliveries; it is never stored in the spec,
    returned, logged or handed to the job (`exclude=True` leaves it out of every dump: `service.workflows.notifications`
    keeps it)."""

    secret: str | None = Field(
        None, min_length=MIN_SECRET_LENGTH, max_length=MAX_SECRET_LENGTH, exclude=True, repr=False,
        description="signs this entry's deliveries (default: the cluster's SHUNTER_WEBHOOK_SECRET); write-only",
    )  # fmt: skip

    _secret = field_validator("secret")(check_secret)


class ClusterWebhook(Delivery):
    """One entry of `SHUNTER_WEBHOOKS`: every job's changes to `events`, signed with its own secret or the cluster's."""

    secret: str | None = Field(None, min_length=MIN_SECRET_LENGTH, max_length=MAX_SECRET_LENGTH, repr=False)

    _secret = field_validator("secret")(check_secret)
