"""The CLI's two consoles, shared by `api.launchers` and `api.commands`: results to stdout, messages to stderr."""

from __future__ import annotations

from rich.console import Console

console = Console()
# Messages are never folded at the terminal's width: one message, one line, for grep and scripts (an error naming a
# long path was folded mid-message in an 80-column pipe).
err = Console(stderr=True, soft_wrap=True)
