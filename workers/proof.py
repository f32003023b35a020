"""The job's side of storage that proves its bytes: the code a process is about to import, and the checkpoint it is
about to load, are the ones their owner's attempts wrote, as the service recorded them (issue 35).

Every job can write the storage root, and every job's processes on a node can write the folders Ray unpacked other
jobs' code into: a file there proves nothing by itself. What proves it is what the service recorded when the owner
wrote it, handed to this attempt by the service, never read from that storage:

- **Code.** `POST /v1/code` recorded what the archive unpacks to (`service.tenancy.code_manifest`); the dispatcher puts
its
  digest in the attempt's environment (`SHUNTER_CODE_DIGEST`, with the archive's URI in `SHUNTER_CODE_URI`).
  `verify_code` compares the working directory Ray unpacked with it, in the driver before anything of the job's is
  looked at and in every train worker before the job's code is imported. A changed, missing or extra code file
  (`runnable`), or a link, and nothing of the job runs: `StorageTampered`, which ends the attempt `storage_tampered`.
  Extra data files are what a job wrote into its own folder, accepted.
- **Checkpoints.** The attempt that reported a checkpoint sent its manifest's sha256, which the service keeps with the
  checkpoint's row (`Checkpoint.manifest_sha256`). `prove_checkpoint` checks the manifest on storage against it, then
  (`workers.manifest.check`) every file against the manifest, before a byte of the checkpoint is loaded.

Stdlib and shunter's own modules only: the driver runs `verify_code` before it imports anything of the job's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from service.tenancy import code_manifest

log = logging.getLogger(__name__)
ENV_CODE_DIGEST = (
    "SHUNTER_CODE_DIGEST"  # service.dispatch.submission sets it: the digest of the files the archive unpacks to
)
ENV_CODE_URI = "SHUNTER_CODE_URI"  # the archive's URI, for the message
RAY_WORKING_DIRS = "working_dir_files"  # the folder Ray unpacks working_dir archives into, one sub-folder each
# An extra file with one of these endings, or anywhere under a `__pycache__`, is one Python could import or load from
# the folder (its path is on every process's PYTHONPATH): never accepted. Any other extra file is data a job wrote
# into its own working directory (an earlier attempt on the node, whose unpacked folder Ray reuses): it runs nothing,
# and refusing it failed every next attempt of a script that writes `./out` without `entrypoint.outputs`.
RUNNABLE_SUFFIXES = (".py", ".pyc", ".pyo", ".pyw", ".pth", ".so", ".pyd")
SHOWN = 10  # differences named in a message; the rest are counted
SHOWN_CHARS = 500  # and no more of them than this: the job's last event keeps a message's last 1000 characters


class StorageTampered(RuntimeError):
    """Storage holds other bytes than the service recorded when their owner wrote them (another job rewrote them, or
    they were corrupted): nothing of them is run or loaded. The attempt ends `storage_tampered`, not retried."""


def working_dir() -> Path:
    """The folder Ray unpacked this job's working_dir into, on this node: the entry of PYTHONPATH under Ray's
    `working_dir_files` (Ray puts it there for the driver and every worker; a Ray Train worker's current directory is
    another folder by then), else the current directory (a Ray Job's driver starts in it)."""
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if entry and Path(entry).parent.name == RAY_WORKING_DIRS:
            return Path(entry)
    return Path.cwd()


def runnable(path: str) -> bool:
    """True for a path (relative, `/`-separated) Python could import or load from a folder on its path."""
    return path.endswith(RUNNABLE_SUFFIXES) or "__pycache__" in path.split("/")


def verify_working_dir(
    root: str | Path, *, expected: str, uri: str, recorded: Callable[[], dict[str, str] | None] | None = None
) -> int:
    """The number of the archive's files under `root`, once they are those whose digest is `expected`, each as
    uploaded; StorageTampered otherwise. `recorded`: the service's listing of them (asked for only when they differ),
    to name what differs, and to tell data files the job wrote there since (accepted) from anything else: a changed,
    missing or `runnable` extra file, or a link. Without the listing, any difference is refused."""
    files, odd = code_manifest.of_tree(root)
    if not odd and code_manifest.digest(files) == expected:
        return len(files)
    listing = None
    if recorded is not None:
        try:
            listing = recorded()
        except Exception:  # noqa: BLE001 - the refusal stands; only its detail is lost
            log.exception("could not read the archive's recorded listing")
    if listing is not None and code_manifest.digest(listing) == expected:
        written = {p for p in files.keys() - listing.keys() if not runnable(p)}
        found = {p: h for p, h in files.items() if p not in written}
        if not odd and found == listing:
            log.info("working directory %s: every file of %s as uploaded; %d data file(s) written there since "
                     "(not code: accepted): %s", root, uri, len(written), sorted(written)[:SHOWN])  # fmt: skip
            return len(listing)
        lines = code_manifest.differences(listing, found, odd)
    else:
        lines = [f"not a plain file: {p}" for p in odd] or ["its files differ from those recorded at upload"]
    shown = "; ".join(lines[:SHOWN]) + (f"; and {len(lines) - SHOWN} more" if len(lines) > SHOWN else "")
    if len(shown) > SHOWN_CHARS:
        shown = shown[: SHOWN_CHARS - 3] + "..."
    raise StorageTampered(
        f"the working directory unpacked from {uri} is not the code archive its owner uploaded, and none of it was "
        f"run. Something rewrote the archive in storage, or the folder Ray unpacked it into ({root}): a job writes "
        f"its files elsewhere than its working directory. Upload the code again and resubmit. What differs: {shown}"
    )


def verify_code(api: Any = None, root: str | Path | None = None) -> str | None:
    """Check this attempt's working directory against the digest the service handed it; what was checked, or None
    when it handed none (the job ships no code archive of shunter's). StorageTampered when it differs; `api` (a
    `workers.attempt_api.AttemptApi`) names the files that do."""
    expected = os.environ.get(ENV_CODE_DIGEST)
    if not expected:
        return None
    if api is None:
        from workers import context

        api = context.attempt_api()
    recorded = (lambda: api.code_listing()) if api is not None else None
    folder, uri = Path(root) if root is not None else working_dir(), os.environ.get(ENV_CODE_URI, "its code archive")
    count = verify_working_dir(folder, expected=expected, uri=uri, recorded=recorded)
    return f"working directory verified: {count} file(s) of {uri}, as uploaded ({folder})"


def prove_checkpoint(root: str, filesystem: Any = None, *, uri: str, recorded: str | None) -> dict[str, Any] | None:
    """The manifest of the checkpoint at `root` once it is proven: its manifest's sha256 is `recorded` (what the
    service kept when the owning attempt reported it) and every file matches the manifest, sha256 and all.
    StorageTampered otherwise. `recorded` None: the service holds no hash for it (reported before hashes were kept,
    or listed from a restore whose report was lost): only the files are checked against the manifest found, and the
    manifest is returned as before (None when the checkpoint has none)."""
    from workers import manifest

    verdict = manifest.check(root, filesystem, checksums=True)
    if recorded is None:
        return verdict.manifest if verdict.complete else None
    if verdict.manifest_sha256 != recorded:
        found = verdict.manifest_sha256 or "none"
        raise StorageTampered(
            f"checkpoint {uri}: its {manifest.MANIFEST} is not the one its attempt reported (sha256 "
            f"{found}, recorded {recorded}); nothing of it was loaded. Something rewrote it after it was written; "
            "resubmit with checkpoint.resume_from naming an earlier checkpoint, or none"
        )
    if not verdict.complete:
        raise StorageTampered(
            f"checkpoint {uri}: {verdict.reason}, though its manifest is the one its attempt "
            "reported; nothing of it was loaded. Something rewrote its files after it was written; resubmit with "
            "checkpoint.resume_from naming an earlier checkpoint, or none"
        )
    return verdict.manifest


def recorded_manifest(uri: str) -> str | None:
    """The sha256 of checkpoint `uri`'s manifest as the service recorded it when the attempt that wrote it reported
    it: asked of the service, never read from the storage every job can write. None outside shunter, and for a
    checkpoint the service holds no hash of (reported before hashes were kept, or listed from a restore whose report
    was lost): that one is checked against its own manifest only, as before, and said so in the log."""
    from workers import context

    api = context.attempt_api()
    if api is None:
        return None
    recorded = api.checkpoint_record(uri)
    if recorded is None:
        log.warning("checkpoint %s: the service recorded no manifest hash for it; its files are checked against its "
                    "own manifest only", uri)  # fmt: skip
    return recorded
