"""The control plane imports without the training stack, and `service` never imports `api`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

BLOCK_TRAINING_STACK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {'torch', 'transformers', 'deepspeed', 'accelerate'}:
            raise ImportError(f'control plane imported {name}')
sys.meta_path.insert(0, Block())
"""


def test_control_plane_imports_without_torch() -> None:
    modules = sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts)
        for pkg in ("api", "service")
        for p in (ROOT / pkg).rglob("*.py")
        if p.name != "__init__.py" and "migrations" not in p.parts  # Alembic runs those, not imports
    )
    code = BLOCK_TRAINING_STACK + "".join(f"import {m}\n" for m in modules) + "from api.app import create_app\n"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_service_never_imports_api() -> None:
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "service").rglob("*.py")
        if any(line.startswith(("from api", "import api")) for line in p.read_text().splitlines())
    ]
    assert offenders == []
