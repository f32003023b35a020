"""CLI profiles: a server and a token by name, in `~/.config/shunter/config.toml` (or `$XDG_CONFIG_HOME/shunter`):

    default = "prod"                      # the profile used without --profile (optional)

    [profiles.prod]
    server = "https://shunter.example.com"
    token = "..."

Precedence, per value: the command's flag, then `SHUNTER_URL` / `SHUNTER_TOKEN`, then the profile (`--profile`, or
`SHUNTER_PROFILE`, or the file's `default`). A file that holds a token must be private to its user (mode 0600): one
that others can read is refused, as ssh refuses a readable key.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

import tomllib

selected: str | None = None  # the root command's --profile (api.cli)


class ProfileError(ValueError):
    pass


@dataclass(frozen=True)
class Profile:
    server: str | None = None
    token: str | None = None


def config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "shunter" / "config.toml"


def load(name: str | None = None) -> Profile:
    """The named profile (`selected`, `SHUNTER_PROFILE`, or the file's `default`); an empty one when none is named
    and the file names no default. A named profile that does not exist is an error."""
    path = config_path()
    name = name or selected or os.environ.get("SHUNTER_PROFILE")
    if not path.exists():
        if name:
            raise ProfileError(f"profile {name!r}: {path} does not exist")
        return Profile()
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ProfileError(f"{path}: {exc}") from exc
    name = name or data.get("default")
    if not name:
        return Profile()
    found = (data.get("profiles") or {}).get(name)
    if not isinstance(found, dict):
        known = ", ".join(sorted(data.get("profiles") or {})) or "none"
        raise ProfileError(f"profile {name!r} is not in {path} (profiles: {known})")
    unknown = set(found) - {"server", "token"}
    if unknown:
        raise ProfileError(f"{path}: profiles.{name}: unknown keys {sorted(unknown)} (server, token)")
    if found.get("token") and stat.S_IMODE(path.stat().st_mode) & 0o077:
        raise ProfileError(f"{path} holds a token and others can read it: chmod 600 {path}")
    return Profile(server=found.get("server"), token=found.get("token"))
