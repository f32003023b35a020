"""Secrets a job names (issue 38): stored encrypted, by owner, team or cluster; given to the job's ranks only.

- **Storing.** `PUT /v1/secrets/{name}` keeps a value for the caller (scope `owner`); an admin may also keep one for a
  team or the whole cluster. `GET /v1/secrets` lists names, never values; nothing else the API answers holds one.
- **At rest.** Values are encrypted (Fernet: AES-128-CBC with an HMAC-SHA256) with a key derived from
  `SHUNTER_SECRETS_KEY`; values written under one of `SHUNTER_SECRETS_PREVIOUS_KEYS` are still read, and written
  again under the current key when next set. Unset, a key is made once and kept in the `secret_keys` table: the
  values are then no safer than the database, so a deployment that wants more sets the key from its own secret store.
- **Names** are environment-variable names (`[A-Z_][A-Z0-9_]*`), none starting with `SHUNTER_` or `RAY_`. A job's
  `secrets: [NAME, ...]` gets each under exactly its name: its owner's, else its team's, else the cluster's.
- **Delivery.** The stored spec holds names only, and the Ray Job's runtime_env neither names nor holds them. Each rank
  asks the API for its job's values at start (`GET /internal/v1/attempts/.../secrets`, with its attempt token) and
  sets them in its environment before the job's code runs (`workers.context.load_secrets`).
- **Masking.** The logs shunter keeps and serves have each value starred out (`service.core.masking`).
"""

from __future__ import annotations

import base64
import hashlib
import secrets as random
import time
import weakref
from collections.abc import Iterable
from enum import StrEnum

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from sqlalchemy import func
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection, Engine
from sqlmodel import Session, col, select

from service.config.settings import Settings
from service.core.errors import Conflict, Forbidden, InvalidSpec, NotFound
from service.core.masking import NOTHING, Masker
from service.spec.secret_names import MAX_VALUE_CHARS, name_problem
from service.store.db import base_engine, session_scope
from service.store.models import Job, Secret, SecretKey, utcnow

MASK_SECONDS = 30.0  # how long a process keeps a job's mask before reading its values again


class Scope(StrEnum):
    owner = "owner"
    team = "team"
    cluster = "cluster"


# ---- the key ----------------------------------------------------------------------------------------------------
def _fernet_key(material: str) -> bytes:
    return base64.urlsafe_b64encode(hashlib.sha256(b"shunter-secrets\0" + material.encode()).digest())


_stored: weakref.WeakKeyDictionary[Engine, str] = weakref.WeakKeyDictionary()


def _stored_key(bind: Engine | Connection) -> str:
    engine = base_engine(bind)
    key = _stored.get(engine)
    if key is None:
        with session_scope(engine) as session:
            insert = pg_insert if engine.dialect.name == "postgresql" else sqlite_insert
            row = {"kid": "default", "key": random.token_urlsafe(32), "created_at": utcnow()}
            session.execute(insert(SecretKey).values(**row).on_conflict_do_nothing(index_elements=["kid"]))
            key = session.exec(select(SecretKey.key).where(SecretKey.kid == "default")).one()
        _stored[engine] = key
    return key


def cipher(engine: Engine | Connection, settings: Settings) -> MultiFernet:
    """The current key first (it encrypts), then the previous ones (they still decrypt)."""
    materials = [settings.secrets_key or _stored_key(engine), *(k for k in settings.secrets_previous_keys if k)]
    return MultiFernet([Fernet(_fernet_key(m)) for m in materials])


# ---- storing ----------------------------------------------------------------------------------------------------
def _row(session: Session, scope: Scope, holder: str, name: str) -> Secret | None:
    return session.exec(
        select(Secret).where(Secret.scope == scope.value, Secret.holder == holder, Secret.name == name)
    ).first()


def put(session: Session, settings: Settings, *, scope: Scope, holder: str, name: str, value: str, by: str) -> Secret:
    """Keep `value` as `name` for the holder (replacing what it had); 403 for a reserved name, 409 past the count."""
    problem = name_problem(name)
    if problem:  # the route's pattern has the form: what is left is a reserved name, which nobody may keep
        raise Forbidden(f"name: {problem}", field="name")
    if not 0 < len(value) <= MAX_VALUE_CHARS:
        raise InvalidSpec(f"value: 1 to {MAX_VALUE_CHARS} characters", field="value")
    ciphertext = cipher(session.get_bind(), settings).encrypt(value.encode()).decode()
    row = _row(session, scope, holder, name)
    if row is None:
        count = session.exec(
            select(func.count()).select_from(Secret).where(Secret.scope == scope.value, Secret.holder == holder)
        ).one()
        if count >= settings.max_secrets_per_holder:
            raise Conflict(f"{scope.value} {holder or 'cluster'} already keeps {count} secrets "
                           f"(max_secrets_per_holder): delete one first")  # fmt: skip
        row = Secret(scope=scope.value, holder=holder, name=name, ciphertext=ciphertext, updated_by=by)
    else:
        row.ciphertext, row.updated_at, row.updated_by = ciphertext, utcnow(), by
    session.add(row)
    session.flush()
    return row


def delete(session: Session, *, scope: Scope, holder: str, name: str) -> None:
    row = _row(session, scope, holder, name)
    if row is None:
        raise NotFound(f"no {scope.value} secret {name}" + (f" of {holder}" if holder else ""))
    session.delete(row)


def visible(session: Session, *, owner: str, team: str | None, admin: bool) -> list[Secret]:
    """The secrets a caller may name: its own, its team's and the cluster's (an admin: all of them)."""
    query = select(Secret).order_by(Secret.scope, Secret.holder, Secret.name)
    if not admin:
        mine = (Secret.scope == Scope.owner.value) & (Secret.holder == owner)
        theirs = (Secret.scope == Scope.team.value) & (Secret.holder == (team or ""))
        query = query.where(mine | theirs | (Secret.scope == Scope.cluster.value))
    return list(session.exec(query).all())


# ---- a job's ----------------------------------------------------------------------------------------------------
def resolve(session: Session, names: Iterable[str], *, owner: str, team: str | None) -> dict[str, Secret | None]:
    """Each name's secret for a job of `owner` (of `team`): the owner's, else the team's, else the cluster's."""
    wanted = list(dict.fromkeys(names))
    if not wanted:
        return {}
    holders = [(Scope.owner.value, owner), (Scope.cluster.value, "")] + ([(Scope.team.value, team)] if team else [])
    rows = session.exec(select(Secret).where(col(Secret.name).in_(wanted))).all()
    rank = {Scope.owner.value: 0, Scope.team.value: 1, Scope.cluster.value: 2}
    found: dict[str, Secret | None] = dict.fromkeys(wanted)
    for row in sorted(rows, key=lambda r: rank.get(r.scope, 9), reverse=True):
        if (row.scope, row.holder) in holders:
            found[row.name] = row  # the nearest holder is written last
    return found


def check_named(session: Session, names: list[str], *, owner: str, team: str | None) -> None:
    """Every secret a spec names is kept for its owner (422 naming the first missing one)."""
    found = resolve(session, names, owner=owner, team=team)
    for i, name in enumerate(names):
        if found.get(name) is None:
            raise InvalidSpec(f"secrets[{i}]: no secret {name} for {owner!r} (keep one with PUT /v1/secrets/{name})",
                              field=f"secrets[{i}]")  # fmt: skip


def values_for(session: Session, settings: Settings, job: Job) -> dict[str, str]:
    """The values of the secrets a job's spec names, as its ranks get them. A name no longer kept raises
    InvalidSpec naming it (the attempt ends as the owner's error)."""
    names = [n for n in (job.spec or {}).get("secrets") or [] if isinstance(n, str)]
    if not names:
        return {}
    box = cipher(session.get_bind(), settings)  # first: a first use makes the stored key in a transaction of its own
    found = resolve(session, names, owner=job.owner, team=job.team)
    missing = [n for n, row in found.items() if row is None]
    if missing:
        raise InvalidSpec(f"secrets: {', '.join(missing)} no longer kept for {job.owner!r}", field="secrets")
    values = _readable(box, [row for row in found.values() if row is not None])
    unreadable = [n for n in found if n not in values]  # written under a key this deployment no longer has
    if unreadable:
        raise InvalidSpec(f"secrets: {unreadable[0]} cannot be read with this service's keys; set it again",
                          field="secrets")  # fmt: skip
    return values


_masks: dict[str, tuple[float, Masker]] = {}


def masker_for(engine: Engine, settings: Settings, job_id: str) -> Masker:
    """What to star out of a job's logs: its secrets' values (read again every `MASK_SECONDS`); none if it names
    none, or they cannot be read."""
    kept = _masks.get(job_id)
    now = time.monotonic()
    if kept is not None and now - kept[0] < MASK_SECONDS:
        return kept[1]
    with Session(engine) as session:
        job = session.get(Job, job_id)
        if job is None or not (job.spec or {}).get("secrets"):
            mask = NOTHING
        else:  # what is still kept and readable (a job whose secret went is masked for the rest)
            box = cipher(engine, settings)
            found = resolve(session, job.spec["secrets"], owner=job.owner, team=job.team)
            mask = Masker(_readable(box, [r for r in found.values() if r is not None]).values())
    if len(_masks) > 10_000:
        _masks.clear()
    _masks[job_id] = (now, mask)
    return mask


def _readable(box: MultiFernet, rows: list[Secret]) -> dict[str, str]:
    """Each row's value by name, for the rows this deployment's keys decrypt."""
    out = {}
    for row in rows:
        try:
            out[row.name] = box.decrypt(row.ciphertext.encode()).decode()
        except InvalidToken:
            continue
    return out
