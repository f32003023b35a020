"""What a code archive unpacks to, file by file: the proof a job's working directory is the code its owner uploaded.

`POST /v1/code` records, with each archive, the sha256 of every file Ray will unpack from it (`of_zip`) and one
digest of that list (`digest`). The dispatcher hands the digest to the attempt (`SHUNTER_CODE_DIGEST`), and the
job's driver and every train worker compare the working directory Ray unpacked (`of_tree`) with it before any of the
user's code is imported (`workers.proof`). The storage the archive lives in is writable by every job, and so is the
folder Ray unpacks it into on a node: only what the service recorded at upload is trusted.

Ray unpacks a remote zip (`file://`, `s3://`, ...) without its top-level folder when everything in it is in one
(`__MACOSX` aside, which it then removes): `of_zip` lists the files as they land. Only files count; folders are made
as needed and an empty one imports nothing. Stdlib only: a job's driver imports it before anything else.
"""

from __future__ import annotations

import hashlib
import json
import ntpath
import os
import stat
import zipfile
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import IO

MACOSX = "__MACOSX"
CHUNK = 1 << 20


def _top_level_folder(names: list[str]) -> str | None:
    """The folder Ray strips (`ray._private.runtime_env.packaging.get_top_level_dir_from_compressed_package`, the same
    rule member by member), or None when it strips nothing."""
    top: str | None = None
    for name in names:
        if top is None:
            if "/" not in name:
                return None
            first = name.split("/")[0]
            if first == MACOSX:
                continue
            unsafe = (not first or first in (os.curdir, os.pardir) or "\\" in first or os.path.isabs(first)
                      or ntpath.isabs(first) or ntpath.splitdrive(first)[0])  # fmt: skip
            if unsafe:
                return None
            top = first
        elif "/" not in name or name.split("/")[0] not in (top, MACOSX):
            return None
    return top


def of_zip(handle: IO[bytes]) -> dict[str, str]:
    """{relative path: sha256} of every file the zip unpacks to under Ray's rule for remote archives (a checked zip:
    `service.tenancy.code_store.check_archive`). A name given twice is the last one's content, as unpacking writes
    it."""
    handle.seek(0)
    files: dict[str, str] = {}
    with zipfile.ZipFile(handle) as archive:
        members = archive.infolist()
        top = _top_level_folder([m.filename for m in members])
        for member in members:
            if member.is_dir():
                continue
            parts = PurePosixPath(member.filename).parts
            if top is not None:
                if parts[0] == MACOSX:
                    continue  # Ray removes it with the top-level folder
                parts = parts[1:]
            if not parts:
                continue
            digest = hashlib.sha256()
            with archive.open(member) as stream:
                while block := stream.read(CHUNK):
                    digest.update(block)
            files["/".join(parts)] = digest.hexdigest()
    return files


def digest(files: dict[str, str]) -> str:
    """One sha256 for a whole listing (paths sorted, compact JSON): what the dispatcher hands an attempt."""
    return hashlib.sha256(json.dumps(sorted(files.items()), separators=(",", ":")).encode()).hexdigest()


def _sha256_of(path: str) -> str:
    digest_ = hashlib.sha256()
    with open(path, "rb") as stream:
        while block := stream.read(CHUNK):
            digest_.update(block)
    return digest_.hexdigest()


def of_tree(root: str | Path) -> tuple[dict[str, str], list[str]]:
    """({relative path: sha256} of every regular file under `root`, [paths of anything else there]): a link or a
    special file is never what Ray unpacks, so it is listed apart, and never followed or read."""
    root = os.fspath(root)
    files: dict[str, str] = {}
    odd: list[str] = []
    for folder, dirs, names in os.walk(root, followlinks=False):
        relative = os.path.relpath(folder, root)
        prefix = "" if relative == os.curdir else relative.replace(os.sep, "/") + "/"
        for name in list(dirs):
            if os.path.islink(os.path.join(folder, name)):
                odd.append(prefix + name)
                dirs.remove(name)
        for name in names:
            path = os.path.join(folder, name)
            mode = os.lstat(path).st_mode
            if stat.S_ISREG(mode):
                files[prefix + name] = _sha256_of(path)
            else:
                odd.append(prefix + name)
    return files, sorted(odd)


def differences(expected: dict[str, str], found: dict[str, str], odd: Sequence[str] = ()) -> list[str]:
    """What differs, one line per file, changed first: 'changed: a.py', 'missing: b.py', 'extra: c.py'."""
    changed = [f"changed: {p}" for p in sorted(expected.keys() & found.keys()) if expected[p] != found[p]]
    missing = [f"missing: {p}" for p in sorted(expected.keys() - found.keys())]
    extra = [f"extra: {p}" for p in sorted(found.keys() - expected.keys())]
    return changed + missing + extra + [f"not a plain file: {p}" for p in odd]
