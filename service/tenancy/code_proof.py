"""The service's side of code archives that prove their bytes (issue 35): what an archive unpacks to, recorded when it
is uploaded, and handed to each attempt that runs it.

- **At upload** (`record`): `POST /v1/code` lists every file the checked zip unpacks to, with its sha256
  (`service.tenancy.code_manifest.of_zip`), and keeps the listing and its digest on the archive's row
  (`CodeArchive.tree`, `CodeArchive.tree_sha256`). The bytes listed are the ones the caller sent, never the stored
  file's.
- **At each attempt** (`for_attempt`): the dispatcher gives the attempt the digest (`SHUNTER_CODE_DIGEST`) of the
  archive its `runtime_env.working_dir` names; the driver and every train worker check the folder Ray unpacked against
  it before anything of the job's runs (`workers.proof`). Where the storage is a local (shared) path the dispatcher also
  reads the stored archive first: bytes that are no longer those of its name (the sha256 of the upload) end the attempt
  `storage_tampered` before Ray ever unpacks them (`ArchiveTampered`).
- **An archive stored before these records** has no listing yet: its first attempt makes it from the stored file,
  once the file is proven to be its upload (its sha256 is its name; the name is what the API computed from the bytes
  it received), and a file that is not is tampered.
"""

from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass
from typing import IO, Any

from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from service.config.settings import Settings
from service.core.errors import InvalidSpec
from service.core.locations import filesystem_for
from service.spec.job import JobSpec
from service.store.db import session_scope
from service.store.models import CodeArchive, Job
from service.tenancy import code_manifest, code_store

FIELD = "runtime_env.working_dir"


class ArchiveTampered(InvalidSpec):
    """The stored archive is not the bytes its owner uploaded: the attempt ends `storage_tampered`, never retried (a
    tampered archive stays tampered until its owner uploads it again)."""


@dataclass(frozen=True)
class CodeProof:
    """What an attempt is handed to prove its working directory by."""

    uri: str
    digest: str


def record(engine: Engine, *, owner: str, sha256: str, files: dict[str, str]) -> None:
    """Keep what the archive `owner` uploaded unpacks to (`code_manifest.of_zip` of the bytes received) on its row,
    made by `service.tenancy.code_archives.record_upload`; the same content again has the same listing."""
    with session_scope(engine) as session:
        row = session.exec(select(CodeArchive).where(CodeArchive.owner == owner, CodeArchive.sha256 == sha256)).first()
        if row is not None and row.tree_sha256 is None:
            row.tree, row.tree_sha256 = files, code_manifest.digest(files)
            session.add(row)


def _row(session: Session, folder: str, sha256: str) -> CodeArchive | None:
    rows = session.exec(select(CodeArchive).where(CodeArchive.sha256 == sha256)).all()
    return next((r for r in rows if code_store.owner_segment(r.owner) == folder), None)


def _spool(settings: Settings, folder: str, sha256: str) -> IO[bytes] | None:
    """The stored archive's bytes (spooled to disk past 8 MiB), or None when there is no such file."""
    relative = f"{code_store.CODE_DIR}/{folder}/{sha256}.zip"
    spool = tempfile.SpooledTemporaryFile(max_size=8 << 20)  # noqa: SIM115 - handed to the caller, who closes it
    local = code_store._local_root(settings)
    try:
        if local is not None:
            path = local.resolve() / relative
            if not path.is_file():
                spool.close()
                return None
            with path.open("rb") as stream:
                while chunk := stream.read(code_store.CHUNK):
                    spool.write(chunk)
        else:
            root, filesystem = filesystem_for(settings.absolute_storage_uri())
            if filesystem is None:
                from pyarrow import fs

                filesystem, root = fs.FileSystem.from_uri(root)
            try:
                with filesystem.open_input_stream(f"{root.rstrip('/')}/{relative}") as stream:
                    while chunk := stream.read(code_store.CHUNK):
                        spool.write(chunk)
            except FileNotFoundError:
                spool.close()
                return None
    except BaseException:
        spool.close()
        raise
    spool.seek(0)
    return spool


def _sha256(handle: IO[bytes]) -> str:
    digest = hashlib.sha256()
    handle.seek(0)
    while chunk := handle.read(code_store.CHUNK):
        digest.update(chunk)
    return digest.hexdigest()


def _tampered(uri: str, found: str) -> ArchiveTampered:
    return ArchiveTampered(
        f"{FIELD}: the stored code archive {uri} is not the one its owner uploaded (its sha256 is {found}, its name "
        "says otherwise): something rewrote it in storage, and none of it was run; upload the code again and resubmit",
        field=FIELD,
    )


def for_attempt(session: Session, settings: Settings, spec: JobSpec) -> CodeProof | None:
    """The proof the attempt's working directory is checked by, when its `runtime_env.working_dir` is an archive of
    `POST /v1/code`; None for any other working_dir (or none). ArchiveTampered when the stored archive is proven
    rewritten; InvalidSpec when it is gone."""
    uri = spec.runtime_env.get("working_dir")
    parsed = code_store.parse_uri(uri, settings) if isinstance(uri, str) else None
    if parsed is None or not isinstance(uri, str):
        return None
    folder, sha256 = parsed
    row = _row(session, folder, sha256)
    digest = row.tree_sha256 if row is not None else None
    if digest is not None and code_store._local_root(settings) is None:
        return CodeProof(uri=uri, digest=digest)  # an object store: read by the attempt's own check only
    spool = _spool(settings, folder, sha256)
    if spool is None:
        if digest is not None:  # gone since (Ray will not find it either); nothing else can be unpacked as it
            return CodeProof(uri=uri, digest=digest)
        raise InvalidSpec(f"{FIELD}: no code archive {sha256}.zip is stored; upload it again with POST /v1/code",
                          field=FIELD)  # fmt: skip
    with spool:
        found = _sha256(spool)
        if found != sha256:
            raise _tampered(uri, found)
        if digest is not None:
            return CodeProof(uri=uri, digest=digest)
        files = code_manifest.of_zip(spool)  # proven the upload's bytes: its listing is the upload's
        size = spool.seek(0, 2)
    digest = code_manifest.digest(files)
    with session_scope(session.get_bind()) as writer:  # type: ignore[arg-type]  # the API's sessions are bound to an Engine
        again = _row(writer, folder, sha256)
        if again is None:  # stored before rows were kept, and not submitted since: the folder names its owner
            writer.add(CodeArchive(owner=folder, sha256=sha256, size=size, tree=files, tree_sha256=digest))
        elif again.tree_sha256 is None:
            again.tree, again.tree_sha256 = files, digest
            writer.add(again)
    return CodeProof(uri=uri, digest=digest)


def listing(session: Session, settings: Settings, job: Job) -> dict[str, Any] | None:
    """What the job's code archive unpacks to, as recorded (`CodeListing` of the internal API), or None."""
    uri = (job.spec.get("runtime_env") or {}).get("working_dir") if isinstance(job.spec, dict) else None
    parsed = code_store.parse_uri(uri, settings) if isinstance(uri, str) else None
    row = _row(session, *parsed) if parsed is not None else None
    if row is None or row.tree is None or row.tree_sha256 is None:
        return None
    return {"uri": uri, "sha256": row.sha256, "digest": row.tree_sha256, "files": dict(row.tree)}
