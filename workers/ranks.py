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


def barrier() -> None:
    """Wait for every rank of the process group; nothing to wait for without one, or alone in it."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def any_rank(flag: bool) -> bool:
    """Whether `flag` is true on any rank: a collective (every rank must call it), the same answer everywhere. On the
    backend's own device (NCCL reduces only CUDA tensors); without a process group, the flag itself."""
    if world()[1] == 1:
        return flag
    import torch

    on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    tensor = torch.tensor([1 if flag else 0], device=on)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item())
