"""Where this process stands in its worker group: the one place that asks torch.distributed for rank and size.

The strategies and the checkpoint helpers both need it; neither owns it, so neither has to import the other for it.
"""

from __future__ import annotations

import torch.distributed as dist


def world() -> tuple[int, int]:
    """(rank, world size) of this process; (0, 1) when no process group is up."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
