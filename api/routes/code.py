"""/v1/code: upload a zip of code once, get a URI for `runtime_env.working_dir` (what `ray job submit --working-dir`
does through the GCS, here kept in the service's storage under the caller; see `service.tenancy.code_store`)."""

from __future__ import annotations

import hashlib
import tempfile

from fastapi import APIRouter, Request, status
from pydantic import BaseModel, Field
from sqlalchemy.engine import Engine
from starlette.concurrency import run_in_threadpool

from api.deps import CallerDep, RuntimeDep, SettingsDep
from api.schemas import ERROR_RESPONSES
from service.config.settings import Settings
from service.core.errors import InvalidSpec
from service.tenancy import code_archives, code_manifest, code_proof, code_store

router = APIRouter(prefix="/v1/code", tags=["code"], responses=ERROR_RESPONSES)
_BINARY = {"schema": {"type": "string", "format": "binary"}}
# application/zip is what clients send; octet-stream is listed too, so generic OpenAPI tools can send bytes.
ZIP_BODY = {"required": True, "content": {"application/zip": _BINARY, "application/octet-stream": _BINARY}}
SPOOL_BYTES = 8 << 20  # archives up to this size stay in memory while checked


class CodeUpload(BaseModel):
    uri: str = Field(description="put it in the spec's runtime_env.working_dir")
    sha256: str
    size: int = Field(description="bytes")


def _store(
    engine: Engine, settings: Settings, owner: str, spool: tempfile.SpooledTemporaryFile[bytes], sha256: str, size: int
) -> str:
    """Quota first (before the archive's CPU is spent), then the archive's check, its record, its file."""
    code_archives.check_quota(engine, settings, owner=owner, sha256=sha256, size=size)
    code_store.check_archive(spool, max_entries=settings.max_code_entries,
                             max_unpacked_bytes=settings.max_code_unpacked_bytes)  # fmt: skip
    files = code_manifest.of_zip(spool)  # what Ray will unpack, from the bytes received: each attempt checks by it
    created = code_archives.record_upload(engine, settings, owner=owner, sha256=sha256, size=size)
    try:
        code_proof.record(engine, owner=owner, sha256=sha256, files=files)
        return code_store.store(settings, owner, spool, sha256)
    except BaseException:
        if created:
            code_archives.forget(engine, owner=owner, sha256=sha256)
        raise


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=CodeUpload,
    responses={
        413: {
            "description": "larger than SHUNTER_MAX_CODE_BYTES, unpacking to more than "
            "SHUNTER_MAX_CODE_UNPACKED_BYTES or SHUNTER_MAX_CODE_ENTRIES members, or taking the caller's archives "
            "over SHUNTER_MAX_CODE_BYTES_PER_OWNER"
        }
    },
    openapi_extra={"requestBody": ZIP_BODY},
)
async def upload_code(request: Request, caller: CallerDep, settings: SettingsDep, runtime: RuntimeDep) -> CodeUpload:
    """Store a zip archive (the request body, `Content-Type: application/zip`) as the caller's code.

    Members must be relative paths inside the archive. Same content, same URI, at no cost to the caller's storage
    quota (`SHUNTER_MAX_CODE_BYTES_PER_OWNER`, all their archives together). An archive unused (not uploaded again,
    not named by a submitted job) for `SHUNTER_CODE_RETENTION_DAYS` and named by no job that has not ended is
    deleted; a job naming it afterwards is refused, and the same upload stores it again. A zip holding one top-level
    folder is unpacked without it by Ray, so zip a folder's contents or the folder itself, either works.
    """
    limit = settings.max_code_bytes
    too_large = code_store.ArchiveTooLarge(f"body: a code archive may be at most {limit} bytes", field="body")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    digest, size = hashlib.sha256(), 0
    with tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES) as spool:
        async for chunk in request.stream():  # counted as it arrives: a lying or absent Content-Length changes nothing
            size += len(chunk)
            if size > limit:
                raise too_large
            digest.update(chunk)
            spool.write(chunk)
        if size == 0:
            raise InvalidSpec("body: empty; send a zip archive", field="body")
        sha256 = digest.hexdigest()
        uri = await run_in_threadpool(_store, runtime.engine, settings, caller.owner, spool, sha256, size)
    return CodeUpload(uri=uri, sha256=sha256, size=size)
