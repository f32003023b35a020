"""The CLI's two consoles, shared by `api.launchers` and `api.commands`: results to stdout, messages to stderr."""

from __future__ import annotations

from rich.console import Console

console = Console()
err = Console(stderr=True)
