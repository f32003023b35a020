"""Attempt tokens: the one credential a job gets, good for writing the progress of its own attempt and nothing else.

A job is arbitrary code, so it never gets the database URL or an API token. The dispatcher gives each attempt a
token naming (job id, attempt number), signed with HMAC-SHA256; the job sends it to the internal API
(`api/routes/internal.py`), which lets it write only that attempt's rows, and only while the job is on that attempt.

Format: `sat1.<key id>.<payload>.<signature>`, where payload is base64url (no padding) of the JSON
`{"j": "<job id>", "a": <attempt>}`, the key id is the first 16 hex digits of a SHA-256 of the key (so every process
derives the same id from the same key, and the id tells nothing of the key), and the signature is base64url of
HMAC-SHA256(key, "sat1.<key id>.<payload>"). The token never expires by time: once its attempt has ended, the fencing
in `service.lifecycle.reports` refuses its writes anyway.

Where the key lives:
- `SHUNTER_PROGRESS_SECRET` set: that is the signing key, and `SHUNTER_PROGRESS_PREVIOUS_SECRETS` (a JSON list) are
  still accepted. Every API and dispatcher process of a deployment must be given the same values. Use a long random
  value, e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`.
- unset: a random key is made once and kept in the `progress_keys` table, so every process sharing the database
  shares it. Keys in that table (and any previous secrets) are all accepted; the newest active one signs.

Rotation (tokens of attempts still running keep working while their key is still accepted):
- explicit secret: give every process `SHUNTER_PROGRESS_SECRET=<new>` and
  `SHUNTER_PROGRESS_PREVIOUS_SECRETS='["<old>"]'`; restart the API processes first, then the dispatchers. Drop the
  old secret once the attempts started before the rotation have ended (at most the longest `timeout_seconds`).
- stored key: `python -m service.tenancy.attempt_tokens rotate` adds a new key that becomes the signing key after
  `ACTIVATION_DELAY_SECONDS`, by when every process has re-read the table (`CACHE_SECONDS`); it keeps the key signing
  now and deletes older ones, so attempts started before the previous rotation lose their progress writes. Rotate at
  most once per longest attempt. No restart is needed.
- from the stored key to an explicit secret: the stored keys stop being accepted once the secret is set, so switch
  while no job runs (running attempts would lose their progress writes; they still finish, and Ray reports how).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import secrets
import sys
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine
from sqlmodel import col, delete, select

from service.config.settings import Settings
from service.store.db import base_engine, session_scope
from service.store.models import ProgressKey, utcnow

PREFIX = "sat1"
# The one credential a Ray Job's runtime_env carries (issue 38): the dashboard shows it, so it buys the attempt token
# once, for the driver that sends it first (api/routes/internal.py, `bootstrap`), and nothing else.
BOOTSTRAP = "sbt1"
MAX_TOKEN_CHARS = 512
CACHE_SECONDS = 30.0  # how long a process keeps the stored keys before reading the table again
ACTIVATION_DELAY_SECONDS = 3 * CACHE_SECONDS  # a rotated-in key signs only once every process accepts it
_JOB_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_KEY_LOCK = 0x53484B59  # "SHKY": one process at a time makes the first stored key (PostgreSQL advisory lock)


class InvalidToken(ValueError):
    """Not a token this deployment signed (malformed, tampered with, or signed by a key no longer accepted)."""


def key_id(key: str) -> str:
    return hashlib.sha256(b"shunter-progress-key-id\0" + key.encode()).hexdigest()[:16]


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(value: str) -> bytes:
    if not re.fullmatch(r"[A-Za-z0-9_-]*", value):
        raise InvalidToken("not base64url")
    return base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))


def _mac(key: str, signed: str) -> bytes:
    return hmac.new(key.encode(), signed.encode(), hashlib.sha256).digest()


def issue(job_id: str, attempt: int, key: str, *, prefix: str = PREFIX, owner: str | None = None) -> str:
    """The token of attempt `attempt` of job `job_id`, signed with `key` (with `prefix=BOOTSTRAP`: its bootstrap
    credential, which only the bootstrap exchange takes). `owner`: the job's, signed into it, so the API's fair gate
    counts the job's requests as its owner's without a database read (`owner_of`)."""
    if not _JOB_ID.fullmatch(job_id) or isinstance(attempt, bool) or attempt < 1:
        raise ValueError(f"cannot issue a token for job {job_id!r} attempt {attempt!r}")
    claims: dict[str, object] = {"j": job_id, "a": attempt}
    if owner:
        claims["o"] = owner
    payload = _b64(json.dumps(claims, separators=(",", ":")).encode())
    signed = f"{prefix}.{key_id(key)}.{payload}"
    return f"{signed}.{_b64(_mac(key, signed))}"


def verify(token: str, keys: Iterable[str], *, prefix: str = PREFIX) -> tuple[str, int]:
    """(job id, attempt) of a token signed by one of `keys` (the current key and the previous ones), else
    `InvalidToken`. Signatures are compared in constant time. The prefix is signed: a bootstrap credential is not an
    attempt token, nor the other way round."""
    claims = _verified(token, keys, prefix)
    job_id, attempt = claims["j"], claims["a"]
    if not isinstance(job_id, str) or not isinstance(attempt, int):  # signed by us, so never; said, not assumed
        raise InvalidToken("not an attempt token")
    return job_id, attempt


def owner_of(token: str, keys: Iterable[str]) -> str | None:
    """The owner signed into an attempt token (None: not a valid token, or one issued without it)."""
    try:
        owner = _verified(token, keys, PREFIX).get("o")
    except InvalidToken:
        return None
    return owner if isinstance(owner, str) and owner else None


def _verified(token: str, keys: Iterable[str], prefix: str) -> dict[str, object]:
    if not isinstance(token, str) or len(token) > MAX_TOKEN_CHARS:
        raise InvalidToken("not a token")
    parts = token.split(".")
    if len(parts) != 4 or parts[0] != prefix:
        raise InvalidToken("not a token")
    _, kid, payload, signature = parts
    presented = _unb64(signature)
    signed = f"{prefix}.{kid}.{payload}"
    valid = False
    for key in keys:
        if key and key_id(key) == kid:  # the key id is public: only the signature needs a constant-time compare
            valid |= hmac.compare_digest(_mac(key, signed), presented)
    if not valid:
        raise InvalidToken("bad signature or unknown key")
    try:
        claims = json.loads(_unb64(payload))
        job_id, attempt = claims["j"], claims["a"]
    except (ValueError, TypeError, KeyError) as exc:
        raise InvalidToken("bad payload") from exc
    if not isinstance(job_id, str) or not _JOB_ID.fullmatch(job_id):
        raise InvalidToken("bad job id")
    if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 1:
        raise InvalidToken("bad attempt")
    return dict(claims)


@dataclass(frozen=True)
class Keys:
    """The key that signs new tokens, and every key whose tokens are accepted (`current` among them)."""

    current: str
    accepted: tuple[str, ...]


_cache: weakref.WeakKeyDictionary[Engine, tuple[float, Keys]] = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()


def keys_for(bind: Engine | Connection, settings: Settings) -> Keys:
    """The deployment's keys: the configured secrets, or those stored in the database (made on first use)."""
    previous = tuple(s for s in settings.progress_previous_secrets if s)
    if settings.progress_secret:
        return Keys(settings.progress_secret, (settings.progress_secret, *previous))
    engine = base_engine(bind)
    with _cache_lock:
        hit = _cache.get(engine)
        if hit is not None and hit[0] > time.monotonic():
            return hit[1]
    stored = _stored_keys(engine)
    keys = Keys(stored.current, (*stored.accepted, *previous))
    with _cache_lock:
        _cache[engine] = (time.monotonic() + CACHE_SECONDS, keys)
    return keys


def cached_keys(bind: Engine | Connection | None, settings: Settings) -> Keys | None:
    """The keys as `keys_for` last read them, without reading the database (None when not read yet or stale): for
    what must not wait on it, such as the API's gate on its event loop."""
    if settings.progress_secret:
        previous = tuple(s for s in settings.progress_previous_secrets if s)
        return Keys(settings.progress_secret, (settings.progress_secret, *previous))
    if bind is None:
        return None
    with _cache_lock:
        hit = _cache.get(base_engine(bind))
    return hit[1] if hit is not None and hit[0] > time.monotonic() else None


def forget_cached_keys() -> None:
    """Read the table again on next use (tests; a process that must see a rotation at once)."""
    with _cache_lock:
        _cache.clear()


def _read(session) -> Keys | None:  # noqa: ANN001
    rows = session.exec(select(ProgressKey).order_by(col(ProgressKey.active_from).desc(), col(ProgressKey.kid))).all()
    if not rows:
        return None
    now = utcnow()
    active = [r for r in rows if r.active_from <= now] or rows[-1:]
    return Keys(active[0].secret, tuple(r.secret for r in rows))


def _stored_keys(engine: Engine) -> Keys:
    with session_scope(engine, write=False) as session:
        found = _read(session)
    if found is not None:
        return found
    with session_scope(engine) as session:  # a write transaction: on SQLite, one writer at a time
        if engine.dialect.name == "postgresql":
            session.connection().execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _KEY_LOCK})
        found = _read(session)
        if found is None:
            secret = secrets.token_urlsafe(32)
            session.add(ProgressKey(kid=key_id(secret), secret=secret, active_from=utcnow() - timedelta(seconds=1)))
            session.flush()
            found = _read(session)
    assert found is not None
    return found


def rotate(engine: Engine) -> str:
    """Add a stored key that signs from `ACTIVATION_DELAY_SECONDS` on; keep the one signing now, delete older ones.
    Returns the new key's id. (With `SHUNTER_PROGRESS_SECRET` set, rotate that setting instead.)"""
    current = _stored_keys(engine).current
    secret = secrets.token_urlsafe(32)
    with session_scope(engine) as session:
        keep = {key_id(current), key_id(secret)}
        session.exec(delete(ProgressKey).where(col(ProgressKey.kid).not_in(keep)))
        active_from = utcnow() + timedelta(seconds=ACTIVATION_DELAY_SECONDS)
        session.add(ProgressKey(kid=key_id(secret), secret=secret, active_from=active_from))
    forget_cached_keys()
    return key_id(secret)


def main(argv: list[str]) -> int:
    if argv != ["rotate"]:
        print("usage: python -m service.tenancy.attempt_tokens rotate", file=sys.stderr)
        return 2
    from service.config.settings import get_settings
    from service.store.db import make_engine

    settings = get_settings()
    if settings.progress_secret:
        print("SHUNTER_PROGRESS_SECRET is set: rotate it (see service/tenancy/attempt_tokens.py)", file=sys.stderr)
        return 1
    kid = rotate(make_engine(settings.database_url))
    print(f"new progress key {kid} signs from {ACTIVATION_DELAY_SECONDS:.0f} s from now")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
