"""Every RNG a training process draws from (Python's, NumPy's, torch's CPU and CUDA generators) as plain JSON, and
back: a checkpoint keeps each rank's (`rng-rank<N>.json`, `workers.checkpoint`), and loading it cannot run code,
as unpickling a file from shared storage could."""

from __future__ import annotations

import base64
import random
from typing import Any

import torch

RNG_FORMAT = "shunter-rng-1"  # rng-rank<N>.json; older checkpoints have rng-rank<N>.pkl, which is never unpickled


def _bytes_of(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.cpu().numpy().tobytes()).decode()


def _tensor_of(text: str) -> torch.Tensor:
    return torch.tensor(list(base64.b64decode(text)), dtype=torch.uint8)


def rng_state() -> dict[str, Any]:
    """This process's RNG states as plain JSON (numbers, strings, lists): loading it back cannot run code."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "format": RNG_FORMAT,
        "python": [version, list(internal), gauss],
        "torch": _bytes_of(torch.get_rng_state()),
    }
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state["numpy"] = [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = [_bytes_of(t) for t in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned (also after a JSON round trip)."""
    if state.get("format") != RNG_FORMAT:
        raise ValueError(f"unknown RNG state format {state.get('format')!r}")
    version, internal, gauss = state["python"]
    random.setstate((int(version), tuple(int(v) for v in internal), gauss))
    torch.set_rng_state(_tensor_of(state["torch"]))
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((str(name), np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_tensor_of(t) for t in state["cuda"]])
