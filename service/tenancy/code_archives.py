"""The records of code archives (`models.CodeArchive`; the files are `service.tenancy.code_store`'s): a per-owner
storage quota at upload, the check that a submitted job names an archive that is still there, and the expiry of archives
nobody uses (issue 35, item 7).

- **Quota.** `POST /v1/code` records an archive before its file is written: an owner's archives together may take at
  most `max_code_bytes_per_owner` (413 naming `body` beyond). The same content again is the same archive: it costs
  nothing and only counts as a use.
- **Use.** An upload, and a submission naming the archive (`runtime_env.working_dir` or `py_modules`), set its
  `last_used_at`. A submission naming an archive that has no row and no file (never uploaded, or expired) is a 422.
- **Expiry.** A dispatcher's pass (`expire`) deletes, file then row, each archive unused for `code_retention_days`
  and named by no job that has not ended (a queued, waiting, retrying or running one, a sweep's or a workflow's
  member still to run). Each deletion re-reads its row under a lock in its own transaction, and a submission's use
  is an UPDATE of that row: whichever comes second sees the other (a submission after the deletion is refused).
- **Archives from before the table.** They have no row until they are first used after the upgrade: a submission
  naming one, or its content uploaded again, makes the row from the file (the migration does not read the storage).
"""

from __future__ import annotations

import hashlib
import json
import logging
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from service.config.settings import Settings
from service.core.errors import InvalidSpec
from service.spec.job import JobSpec
from service.store.db import session_scope
from service.store.models import TERMINAL_STATES, CodeArchive, Job, JobState, utcnow
from service.tenancy import code_store

log = logging.getLogger(__name__)
CODE_LOCK_SPACE = 0x434F4445  # "CODE": PostgreSQL advisory locks, one per owner, (space, key) form
EXPIRY_BATCH = 200  # archives one pass looks at
NOT_ENDED = sorted(s.value for s in JobState if s not in TERMINAL_STATES)


def _lock_owner(session: Session, owner: str) -> None:
    """Uploads of one owner take turns between the quota's SUM and the row it adds (SQLite: the write lock does)."""
    if session.get_bind().dialect.name == "postgresql":
        key = int.from_bytes(hashlib.sha256(owner.encode()).digest()[:4], "big", signed=True)
        session.execute(text("SELECT pg_advisory_xact_lock(:space, :key)"), {"space": CODE_LOCK_SPACE, "key": key})


def owner_bytes(session: Session, owner: str) -> int:
    """The bytes of all `owner`'s recorded archives."""
    total = session.exec(select(func.coalesce(func.sum(CodeArchive.size), 0)).where(CodeArchive.owner == owner)).one()
    return int(total or 0)


def _owned(session: Session, owner: str, sha256: str) -> CodeArchive | None:
    return session.exec(select(CodeArchive).where(CodeArchive.owner == owner, CodeArchive.sha256 == sha256)).first()


def _over_quota(used: int, size: int, settings: Settings) -> code_store.ArchiveTooLarge:
    quota = settings.max_code_bytes_per_owner
    return code_store.ArchiveTooLarge(
        f"body: this archive of {size} bytes would take your code archives to {used + size} bytes, over this "
        f"service's max_code_bytes_per_owner ({quota} bytes); archives unused for {settings.code_retention_days:g} "
        "days are deleted, or ask an admin for more",
        field="body",
    )


def check_quota(engine: Engine, settings: Settings, *, owner: str, sha256: str, size: int) -> None:
    """Before an upload is checked (its CPU spent): 413 naming `body` when a new archive would take `owner` over
    `max_code_bytes_per_owner`. `record_upload` decides again under the owner's lock."""
    with Session(engine) as session:
        known = _owned(session, owner, sha256)
        used = owner_bytes(session, owner) if known is None else 0
    if known is None and used + size > settings.max_code_bytes_per_owner:
        raise _over_quota(used, size, settings)


def record_upload(engine: Engine, settings: Settings, *, owner: str, sha256: str, size: int) -> bool:
    """Record an upload before its file is written (an archive being written is thus counted already); True when its
    row is new (the caller calls `forget` if the write then fails). The same content again is a use, at no cost."""
    now = utcnow()
    with session_scope(engine) as session:
        _lock_owner(session, owner)
        row = _owned(session, owner, sha256)
        if row is not None:
            row.last_used_at = now
            session.add(row)
            return False
        used = owner_bytes(session, owner)
        if used + size > settings.max_code_bytes_per_owner:
            raise _over_quota(used, size, settings)
        session.add(CodeArchive(owner=owner, sha256=sha256, size=size, created_at=now, last_used_at=now))
    return True


def forget(engine: Engine, *, owner: str, sha256: str) -> None:
    """Remove the row `record_upload` made for an archive whose file could not be written."""
    with session_scope(engine) as session:
        row = _owned(session, owner, sha256)
        if row is not None:
            session.delete(row)


def named_archives(spec: JobSpec, settings: Settings) -> list[tuple[str, tuple[str, str]]]:
    """(field, (owner folder, sha256)) of each of this service's code archives the spec names."""
    env = spec.runtime_env
    named: list[tuple[str, Any]] = [("runtime_env.working_dir", env.get("working_dir"))]
    modules = env.get("py_modules")
    named += [("runtime_env.py_modules", m) for m in modules] if isinstance(modules, list) else []
    out = []
    for field, value in named:
        parsed = code_store.parse_uri(value, settings) if isinstance(value, str) else None
        if parsed is not None:
            out.append((field, parsed))
    return out


def _touch_spacing(settings: Settings) -> timedelta:
    """A use this soon after the last one written is not written again (a sweep's thousand members: one write). An
    archive is thus deleted at most this much before `code_retention_days` have passed since its last use."""
    return min(timedelta(hours=1), timedelta(days=settings.code_retention_days) / 100)


def use_named(session: Session, spec: JobSpec, settings: Settings, *, owner: str) -> None:
    """At submission: each archive the spec names must still be stored; it counts as used now. One that is not is a
    422 naming its field (`runtime_env.working_dir` / `runtime_env.py_modules`). An archive stored before this
    table existed gets its row here, from its file."""
    now = utcnow()
    for field, (folder, sha256) in named_archives(spec, settings):
        row = _row_of(session, folder, sha256)
        if row is None:
            row = _adopt(session, settings, folder, sha256, owner=owner, now=now)
        elif row.last_used_at < now - _touch_spacing(settings):
            # An UPDATE, not a read: it waits for an expiry pass deleting this row, and then changes nothing.
            done = session.execute(update(CodeArchive).where(col(CodeArchive.id) == row.id).values(last_used_at=now))
            if done.rowcount == 0:  # type: ignore[attr-defined]  # an UPDATE's result is a CursorResult; Session.execute says Result
                row = None
        if row is None:
            raise InvalidSpec(
                f"{field}: no code archive {sha256}.zip is stored (it was never uploaded, or it went unused for "
                f"{settings.code_retention_days:g} days and was deleted); upload it again with POST /v1/code",
                field=field,
            )


def _row_of(session: Session, folder: str, sha256: str) -> CodeArchive | None:
    rows = session.exec(select(CodeArchive).where(CodeArchive.sha256 == sha256)).all()
    return next((r for r in rows if code_store.owner_segment(r.owner) == folder), None)


def _adopt(session: Session, settings: Settings, folder: str, sha256: str, *, owner: str, now: datetime) -> Any:
    """The row of an archive stored before rows were kept (None: no such file either). Its owner is the folder's:
    the submitter's own when the folder is theirs (the only one a non-admin may name), else the folder's name."""
    size = code_store.stored_size(settings, folder, sha256)
    if size is None:
        return None
    values = {"owner": owner if code_store.owner_segment(owner) == folder else folder, "sha256": sha256,
              "size": size, "created_at": now, "last_used_at": now}  # fmt: skip
    table = CodeArchive.__table__  # type: ignore[attr-defined]  # SQLModel sets __table__ when it makes the class
    insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    session.execute(insert(table).values(values).on_conflict_do_nothing())  # an upload of it may have made it meanwhile
    return _row_of(session, folder, sha256)


def archives_in_use(session: Session, settings: Settings) -> set[tuple[str, str]]:
    """(owner folder, sha256) of every archive a job that has not ended names: one pass over those jobs, reading
    only the two runtime_env fields (JSON paths, on SQLite and PostgreSQL alike)."""
    working_dir = col(Job.spec)[("runtime_env", "working_dir")].as_string()
    if session.get_bind().dialect.name == "postgresql":
        py_modules: Any = col(Job.spec)[("runtime_env", "py_modules")].as_json()
    else:  # (SQLAlchemy's as_json wraps it in JSON_QUOTE there, which makes a missing list the text 'null')
        py_modules = func.json_extract(col(Job.spec), "$.runtime_env.py_modules")
    rows = session.exec(
        select(working_dir, py_modules).where(col(Job.state).in_(NOT_ENDED))
        .where(working_dir.is_not(None) | py_modules.is_not(None))
    ).all()  # fmt: skip
    found: set[tuple[str, str]] = set()
    for uri, modules in rows:
        if isinstance(modules, str):  # SQLite's JSON text (a list), or an admin's single string
            try:
                modules = json.loads(modules)
            except ValueError:
                modules = [modules]
        for value in [uri, *(modules if isinstance(modules, list) else [])]:
            parsed = code_store.parse_uri(value, settings) if isinstance(value, str) else None
            if parsed is not None:
                found.add(parsed)
    return found


def expire(engine: Engine, settings: Settings, *, batch: int = EXPIRY_BATCH) -> list[tuple[str, str]]:
    """One expiry pass: delete (file, then row) the archives unused for `code_retention_days` that no job that has not
    ended names; returns (owner, sha256) of those deleted. An old archive a live job names counts as used now."""
    now = utcnow()
    cutoff = now - timedelta(days=settings.code_retention_days)
    with Session(engine) as session:
        old = session.exec(
            select(CodeArchive).where(col(CodeArchive.last_used_at) < cutoff)
            .order_by(col(CodeArchive.last_used_at), col(CodeArchive.id)).limit(batch)
        ).all()  # fmt: skip
        in_use = archives_in_use(session, settings) if old else set()
    kept = [r.id for r in old if (code_store.owner_segment(r.owner), r.sha256) in in_use]
    if kept:  # out of the next passes' batches: the oldest rows never crowd out the ones that may go
        with session_scope(engine) as session:
            session.execute(update(CodeArchive).where(col(CodeArchive.id).in_(kept)).values(last_used_at=now))
    deleted = []
    for row in old:
        if row.id in kept:
            continue
        try:
            if _delete_if_unused(engine, settings, row.id, cutoff):
                deleted.append((row.owner, row.sha256))
        except Exception as exc:  # noqa: BLE001 - the storage's or the database's; this archive waits for the next pass
            log.warning("cannot delete code archive %s of %s: %s", row.sha256, row.owner, exc)
    return deleted


def _delete_if_unused(engine: Engine, settings: Settings, row_id: int | None, cutoff: datetime) -> bool:
    with session_scope(engine) as session:
        row = session.exec(select(CodeArchive).where(CodeArchive.id == row_id).with_for_update()).first()
        if row is None or row.last_used_at >= cutoff:  # used since it was picked: a submission named it
            return False
        code_store.remove(settings, code_store.owner_segment(row.owner), row.sha256)
        session.delete(row)
    return True
