"""What a job spec may ask, by who asks: the two deployment modes in one place (issue 12).

- **Single-user local mode** (no `SHUNTER_API_TOKENS`): every caller is an admin, and a spec keeps its conveniences
  (a local `working_dir`, a `pip` requirements file, its own `checkpoint.storage`).
- **Token mode**: a non-admin's spec may not make the service read its own host for them. Ray's submission client
  zips local `working_dir` / `py_modules` folders and reads `pip` / `uv` / `conda` files *in the dispatcher*, so those
  must be remote URIs (`s3://`, `gs://`, `https://` zips, or the caller's own `POST /v1/code` URI), requirement
  lists and inline conda dicts; and `checkpoint.storage` is the service's (each job under `<storage>/<job id>`), so
  no job can write into another's checkpoints. Admins may do what local mode allows.
- **Reserved variables** (both modes): `runtime_env.env_vars` may not set what shunter sets for its driver or what
  changes how the driver runs or stops (`RESERVED_RAY`, every `SHUNTER_*`); nobody needs to override them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from service.config.settings import Settings
from service.core.errors import InvalidSpec
from service.spec.job import JobSpec
from service.tenancy import code_store

if TYPE_CHECKING:
    from service.tenancy.auth import Caller

RESERVED_PREFIX = "SHUNTER_"  # the job's spec, id, attempt, storage, resume point, progress credential, endpoint
RESERVED_RAY = frozenset(
    {
        "RAY_ADDRESS",  # the cluster the driver joins: admission counted this one
        "RAY_JOB_STOP_SIGNAL",  # how a cancel or a preemption stops the driver (graceful SIGINT on shunter's nodes)
        "RAY_JOB_STOP_WAIT_TIME_S",  # how long a stop waits before killing it
        "RAY_TRAIN_V2_ENABLED",  # which Ray Train the driver builds its trainer on
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S",  # set from SHUNTER_TRAIN_POLL_SECONDS: how fast reports and stops land
    }
)
REMOTE_SCHEMES = frozenset({"s3", "gs", "https"})
_PACKAGE_SUFFIXES = {"working_dir": (".zip",), "py_modules": (".zip", ".whl")}


def is_reserved(name: str) -> bool:
    upper = name.upper()  # pydantic-settings reads SHUNTER_* case-insensitively
    return upper.startswith(RESERVED_PREFIX) or upper in RESERVED_RAY


def restricted(caller: Caller) -> bool:
    """Token mode for a non-admin (without tokens every caller is an admin)."""
    return not caller.admin


def check_spec(spec: JobSpec, caller: Caller, settings: Settings | None) -> None:
    """Raise InvalidSpec naming the field for what `caller` may not ask; see the module docstring."""
    env_vars = spec.runtime_env.get("env_vars") or {}
    for name in env_vars:
        if is_reserved(name):
            field = f"runtime_env.env_vars.{name}"
            raise InvalidSpec(
                f"{field}: reserved; shunter sets SHUNTER_* and {', '.join(sorted(RESERVED_RAY))} for its driver",
                field=field,
            )
    if not restricted(caller):
        return
    if spec.checkpoint.storage is not None:
        raise InvalidSpec(
            "checkpoint.storage: set by the service for non-admin callers (each job under <storage>/<job id>)",
            field="checkpoint.storage",
        )
    _check_runtime_env(spec.runtime_env, caller, settings)


def _check_runtime_env(runtime_env: dict[str, Any], caller: Caller, settings: Settings | None) -> None:
    if "working_dir" in runtime_env:
        _check_package(runtime_env["working_dir"], "runtime_env.working_dir", "working_dir", caller, settings)
    if "py_modules" in runtime_env:
        modules = runtime_env["py_modules"]
        if not isinstance(modules, list):
            raise InvalidSpec("runtime_env.py_modules: must be a list of URIs", field="runtime_env.py_modules")
        for module in modules:
            _check_package(module, "runtime_env.py_modules", "py_modules", caller, settings)
    for key in ("pip", "uv"):
        if key in runtime_env:
            _check_requirements(runtime_env[key], f"runtime_env.{key}")
    if "conda" in runtime_env and not isinstance(runtime_env["conda"], dict):
        raise InvalidSpec(
            "runtime_env.conda: give the environment inline as a mapping; a name or file would be read on the "
            "service's host",
            field="runtime_env.conda",
        )


def _check_requirements(value: Any, field: str) -> None:
    """A list of requirement strings, or Ray's mapping form whose `packages` is such a list (never a file)."""
    packages = value.get("packages") if isinstance(value, dict) else value
    if not isinstance(packages, list) or not all(isinstance(p, str) for p in packages):
        raise InvalidSpec(
            f"{field}: give a list of requirement strings; a requirements file would be read on the service's host",
            field=field,
        )


def _check_package(value: Any, field: str, key: str, caller: Caller, settings: Settings | None) -> None:
    if not isinstance(value, str):
        raise InvalidSpec(f"{field}: must be a URI string", field=field)
    if settings is not None and code_store.is_owned_archive(value, settings, caller.owner):
        return
    parsed = urlparse(value)
    scheme = parsed.scheme.lower()
    if settings is not None and _under_storage(value, settings):
        raise InvalidSpec(
            f"{field}: {value!r} is in the service's storage and is not one of your POST /v1/code archives",
            field=field,
        )
    if scheme not in REMOTE_SCHEMES:
        raise InvalidSpec(
            f"{field}: {value!r} would be read on the service's host; use an s3://, gs:// or https:// zip, or upload "
            "the folder with POST /v1/code (shunter submit --working-dir DIR)",
            field=field,
        )
    suffixes = _PACKAGE_SUFFIXES[key]
    if not parsed.path.lower().endswith(suffixes):
        raise InvalidSpec(f"{field}: a remote {key} must be a {' or '.join(suffixes)} file, got {value!r}", field=field)


def _under_storage(value: str, settings: Settings) -> bool:
    """Whether a URI points into the service's storage (scheme compared as Ray compares it, case-insensitively)."""
    scheme, sep, rest = value.partition("://")
    if not sep:
        return False
    normal = f"{scheme.lower()}://{rest}"
    roots = {code_store.code_root_uri(settings).rsplit("/", 1)[0], settings.absolute_storage_uri()}
    return any(normal.startswith(root.rstrip("/") + "/") for root in roots if "://" in root)
