"""Webhook policy, pure: the signature, which addresses may be called, the retry schedule, the bodies sent.

No I/O here (`service.workflows.webhooks` does the sending, `service.workflows.notifications` the outbox); each function
is table-tested.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

SIGNATURE_HEADER = "X-Shunter-Signature"
EVENT_ID_HEADER = "X-Shunter-Event-Id"
EVENT_TYPE = "job.state_changed"
# A receiver should refuse a signature older than this (a replayed message); `verify` uses it by default.
DEFAULT_TOLERANCE_SECONDS = 300


# ---- signatures -------------------------------------------------------------------------------------------------
def sign(secret: str, body: bytes, *, timestamp: int) -> str:
    """The `X-Shunter-Signature` value: `t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>`."""
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


def verify(secret: str, body: bytes, header: str, *, now: float, tolerance: float = DEFAULT_TOLERANCE_SECONDS) -> bool:
    """What a receiver does: the header parses, its time is within `tolerance` of `now`, and one of its v1 values
    is the HMAC of this body (compared in constant time). Several v1 values are allowed (a secret's rotation)."""
    timestamp: int | None = None
    candidates: list[str] = []
    for part in header.split(","):
        key, _, value = part.strip().partition("=")
        if key == "t" and value.isascii() and value.isdigit():
            timestamp = int(value)
        elif key == "v1":
            candidates.append(value)
    if timestamp is None or not candidates or abs(now - timestamp) > tolerance:
        return False
    expected = sign(secret, body, timestamp=timestamp).rpartition("v1=")[2]
    return any(hmac.compare_digest(expected.encode(), c.encode()) for c in candidates)


# ---- addresses --------------------------------------------------------------------------------------------------
def address_problem(address: str) -> str | None:
    """Why a webhook may not be sent to this IP address (loopback, private, link-local, ...), or None when it is a
    public unicast address. An IPv4 address mapped or embedded in IPv6 is judged as the IPv4 address it carries."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 zone (fe80::1%eth0) is link-local anyway
    except ValueError:
        return f"{address!r} is not an IP address"
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if ip in ipaddress.ip_network("64:ff9b::/96"):  # NAT64: the IPv4 address is the low 32 bits
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None:
            inner = address_problem(str(embedded))
            return f"{ip} carries {inner}" if inner else None
    for kind in ("loopback", "unspecified", "link_local", "multicast", "private", "reserved"):
        if getattr(ip, f"is_{kind}"):
            return f"{ip} is a {kind.replace('_', '-')} address"
    if not ip.is_global:  # shared address space (100.64/10), documentation ranges, ...
        return f"{ip} is not a public address"
    return None


# ---- retries ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 15
    base_seconds: float = 2.0
    cap_seconds: float = 600.0


@dataclass(frozen=True)
class Outcome:
    """What a delivery attempt leads to: `delivered`, `pending` again `retry_in` seconds from now, or `failed`."""

    state: str
    retry_in: float | None = None


def backoff(attempts: int, policy: RetryPolicy, *, jitter: float) -> float:
    """Seconds before the next try after `attempts` failed ones: base x 2^(attempts-1) up to the cap, of which the
    upper half is spread by `jitter` in [0, 1] so that receivers coming back are not all retried at one moment."""
    step = min(policy.cap_seconds, policy.base_seconds * 2.0 ** min(attempts - 1, 60))
    return step / 2 + step / 2 * min(max(jitter, 0.0), 1.0)


def after_attempt(*, attempts: int, ok: bool, permanent: bool, policy: RetryPolicy, jitter: float) -> Outcome:
    """The row's next state after its `attempts`-th try. A permanent fault (an address refused, nothing to sign
    with) is not retried: the same try would fail the same way."""
    if ok:
        return Outcome("delivered")
    if permanent or attempts >= policy.max_attempts:
        return Outcome("failed")
    return Outcome("pending", backoff(attempts, policy, jitter=jitter))


# ---- bodies -----------------------------------------------------------------------------------------------------
def event_document(
    *, event_id: str, job: dict[str, Any], from_state: str | None, to_state: str, reason: str,
    message: str | None, at: datetime,
) -> dict[str, Any]:  # fmt: skip
    """The JSON body of one state change: `id` is stable across retries (receivers de-duplicate on it)."""
    return {
        "id": event_id, "type": EVENT_TYPE, "at": at.isoformat(), "job": job,
        "from_state": from_state, "to_state": to_state, "reason": reason, "message": message,
    }  # fmt: skip


_SLACK_MARK = {"SUCCEEDED": ":white_check_mark:", "FAILED": ":x:", "CANCELLED": ":no_entry_sign:"}


def slack_escape(text: str) -> str:
    """Text a job chose (its name, a reason its driver wrote) as Slack shows it, never as Slack's control sequences:
    `<!channel>` pinged everyone and `<https://x|text>` disguised a link (issue 35). Slack's rule: escape &, <, >."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def slack_document(document: dict[str, Any]) -> dict[str, Any]:
    """A Slack-compatible body (`{"text": ...}`) for an event document."""
    job = document["job"]
    mark = _SLACK_MARK.get(document["to_state"], ":information_source:")
    text = f"{mark} shunter job *{slack_escape(str(job['name']))}* (`{job['id']}`) is {document['to_state']}"
    detail = job.get("state_reason") or document["reason"]
    if detail:
        text += f": {slack_escape(detail[:500])}"
    return {"text": text}


def render(document: dict[str, Any], payload_format: str) -> str:
    """The exact text to send and sign: compact JSON, keys in a fixed order."""
    body = slack_document(document) if payload_format == "slack" else document
    return json.dumps(body, separators=(",", ":"), sort_keys=True, ensure_ascii=False)
