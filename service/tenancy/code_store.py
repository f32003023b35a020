"""Code archives users ship with their jobs (`POST /v1/code`): checked zips, kept in the service's checkpoint storage
under their owner and named by content, `<storage>/code/<owner>/<sha256>.zip`.

The URI handed back is one Ray downloads on the node that runs the job (`runtime_env.working_dir`): `file:///…zip` for
a local (shared) storage path, `s3://…zip` / `gs://…zip` for an object store. Ray reads a `file://` URI on the node,
not in the process that submits, so nothing on the dispatcher's host is read for the job. A remote zip with a single
top-level folder is unpacked without that folder (Ray's rule for remote `working_dir`s).
"""

from __future__ import annotations

import contextlib
import hashlib
import ntpath
import os
import re
import tempfile
import zipfile
from pathlib import Path, PurePosixPath
from typing import IO, Any

from service.config.settings import Settings
from service.core.errors import InvalidSpec, ShunterError
from service.core.locations import filesystem_for

CODE_DIR = "code"
_SAFE_OWNER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
CHUNK = 1 << 20


class ArchiveTooLarge(ShunterError):
    status_code = 413
    code = "too_large"


def owner_segment(owner: str) -> str:
    """The owner's folder name: the owner itself when it is a plain name, else a digest of it (no `/`, no `..`)."""
    if _SAFE_OWNER.fullmatch(owner) and ".." not in owner:
        return owner
    return "u-" + hashlib.sha256(owner.encode()).hexdigest()[:32]


def _local_root(settings: Settings) -> Path | None:
    """The storage folder when the service's storage is a local (or shared) path; None for an object store."""
    uri = settings.absolute_storage_uri()
    scheme, sep, rest = uri.partition("://")
    if not sep:
        return Path(uri)
    return Path(rest) if scheme.lower() == "file" else None


def code_root_uri(settings: Settings) -> str:
    """`<storage>/code` as a URI Ray understands (`file:///…` for a local path); computed, nothing is opened."""
    local = _local_root(settings)
    if local is not None:
        return f"{local.resolve().as_uri().rstrip('/')}/{CODE_DIR}"
    scheme, _, rest = settings.absolute_storage_uri().partition("://")
    return f"{scheme.lower()}://{rest.rstrip('/')}/{CODE_DIR}"


def owner_prefix(settings: Settings, owner: str) -> str:
    """`<code root URI>/<owner>/`: every archive of `owner` starts with it."""
    return f"{code_root_uri(settings)}/{owner_segment(owner)}/"


def is_owned_archive(uri: str, settings: Settings, owner: str) -> bool:
    """True for exactly the URI `POST /v1/code` returns for one of `owner`'s archives (no other spelling)."""
    prefix = owner_prefix(settings, owner)
    if not uri.startswith(prefix):
        return False
    name = uri[len(prefix) :]
    return name.endswith(".zip") and bool(_SHA256.fullmatch(name[: -len(".zip")]))


def parse_uri(uri: str, settings: Settings) -> tuple[str, str] | None:
    """(owner folder, sha256) when `uri` names a `POST /v1/code` archive of this service's storage (the scheme compared
    as Ray compares it, case-insensitively); None for any other URI."""
    scheme, sep, rest = uri.partition("://")
    if not sep:
        return None
    root = code_root_uri(settings) + "/"
    normal = f"{scheme.lower()}://{rest}"
    if not normal.startswith(root):
        return None
    folder, slash, name = normal[len(root) :].partition("/")
    if not slash or not _SAFE_OWNER.fullmatch(folder) or ".." in folder or not name.endswith(".zip"):
        return None
    sha256 = name[: -len(".zip")]
    return (folder, sha256) if _SHA256.fullmatch(sha256) else None


def _object_path(settings: Settings, relative: str) -> tuple[str, Any]:
    root, filesystem = filesystem_for(settings.absolute_storage_uri())
    if filesystem is None:  # gs://, hdfs://, ...: pyarrow finds the filesystem from the URI
        from pyarrow import fs

        filesystem, root = fs.FileSystem.from_uri(root)
    return f"{root.rstrip('/')}/{relative}", filesystem


def stored_size(settings: Settings, folder: str, sha256: str) -> int | None:
    """The bytes of the archive `<storage>/code/<folder>/<sha256>.zip`, or None when there is none."""
    relative = f"{CODE_DIR}/{folder}/{sha256}.zip"
    local = _local_root(settings)
    if local is not None:
        target = local.resolve() / relative
        return target.stat().st_size if target.is_file() else None
    from pyarrow import fs

    path, filesystem = _object_path(settings, relative)
    info = filesystem.get_file_info(path)
    return int(info.size) if info.type == fs.FileType.File else None


def remove(settings: Settings, folder: str, sha256: str) -> None:
    """Delete the archive `<storage>/code/<folder>/<sha256>.zip`; one that is not there is no error."""
    relative = f"{CODE_DIR}/{folder}/{sha256}.zip"
    local = _local_root(settings)
    if local is not None:
        (local.resolve() / relative).unlink(missing_ok=True)
        return
    path, filesystem = _object_path(settings, relative)
    with contextlib.suppress(FileNotFoundError):
        filesystem.delete_file(path)


def check_archive(handle: IO[bytes], *, max_entries: int = 20_000, max_unpacked_bytes: int = 1 << 30) -> None:
    """A readable zip whose members all unpack inside the target folder, at most `max_entries` of them and
    `max_unpacked_bytes` in all; InvalidSpec(field='body') otherwise (ArchiveTooLarge, 413, for the bounds).

    The bounds are read from the archive's directory before any member is decompressed; a member that unpacks to
    more than its directory entry says fails its CRC check (zipfile reads no further than the declared size)."""
    handle.seek(0)
    try:
        with zipfile.ZipFile(handle) as archive:
            members = archive.infolist()
            if len(members) > max_entries:
                raise ArchiveTooLarge(f"body: a code archive may hold at most {max_entries} members, this one holds "
                                      f"{len(members)}", field="body")  # fmt: skip
            unpacked = sum(m.file_size for m in members)
            if unpacked > max_unpacked_bytes:
                raise ArchiveTooLarge(f"body: a code archive may unpack to at most {max_unpacked_bytes} bytes, this "
                                      f"one to {unpacked}", field="body")  # fmt: skip
            for member in members:
                name = member.filename
                parts = PurePosixPath(name).parts
                if (
                    name.startswith("/")
                    or "\\" in name
                    or ntpath.isabs(name)
                    or ntpath.splitdrive(name)[0]
                    or ".." in parts
                    or "\x00" in name
                ):
                    raise InvalidSpec(
                        f"body: archive member {name!r} is an absolute path or leaves the archive's folder",
                        field="body",
                    )
            bad = archive.testzip()
    except zipfile.BadZipFile as exc:
        raise InvalidSpec(f"body: not a zip archive ({exc})", field="body") from exc
    except (EOFError, OSError, NotImplementedError, ValueError, RuntimeError) as exc:
        # A truncated member, an unsupported compression, an encrypted member: Ray could not unpack it either.
        raise InvalidSpec(f"body: the zip archive cannot be read ({exc})", field="body") from exc
    if bad is not None:
        raise InvalidSpec(f"body: archive member {bad!r} is corrupt (CRC mismatch)", field="body")
    if not members:
        raise InvalidSpec("body: the zip archive is empty", field="body")


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while chunk := stream.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def store(settings: Settings, owner: str, handle: IO[bytes], sha256: str) -> str:
    """Write the (checked) archive to `<storage>/code/<owner>/<sha256>.zip`; returns its URI. Same content, same URI."""
    if not _SHA256.fullmatch(sha256):
        raise ValueError(f"not a sha256 hex digest: {sha256!r}")
    relative = f"{CODE_DIR}/{owner_segment(owner)}/{sha256}.zip"
    handle.seek(0)
    local = _local_root(settings)
    if local is not None:
        target = local.resolve() / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        # Written anew when it is not its name's bytes (a job rewrote it: the storage root is every job's).
        if not target.is_file() or _file_sha256(target) != sha256:
            # Write beside it and rename: a reader never sees half an archive.
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".upload-", suffix=".zip")
            try:
                with os.fdopen(fd, "wb") as out:
                    while chunk := handle.read(CHUNK):
                        out.write(chunk)
                os.chmod(tmp, 0o644)
                os.replace(tmp, target)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        return f"{code_root_uri(settings)}/{owner_segment(owner)}/{sha256}.zip"
    path, filesystem = _object_path(settings, relative)
    filesystem.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with filesystem.open_output_stream(path) as out:  # object stores make the object visible only when closed
        while chunk := handle.read(CHUNK):
            out.write(chunk)
    return f"{code_root_uri(settings)}/{owner_segment(owner)}/{sha256}.zip"
