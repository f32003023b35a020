"""Pre-build DeepSpeed's JIT-compiled ops once (`python -m workers.warmup`), so jobs and tests do not each pay for it.

DeepSpeed compiles `deepspeed_shm_comm` on first use on CPU (~20 s) and `cpu_adam` for its CPU Adam / offload
(~40 s); both are cached under `~/.cache/torch_extensions` (or `TORCH_EXTENSIONS_DIR`). Run this in CI's setup step
and in worker images.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

log = logging.getLogger("shunter.warmup")

# op name -> builder class name in `deepspeed.ops.op_builder` (the accelerator picks the CPU or CUDA variant).
OPS = {"shm_comm": "ShareMemCommBuilder", "cpu_adam": "CPUAdamBuilder"}


def use_interpreter_bin_first() -> None:
    """Put this interpreter's bin directory first on PATH, for this process and what it starts.

    torch builds a JIT op with the first `ninja` on PATH and rebuilds it when ninja's log holds another hash of the
    build's command. Ninja 1.12 changed that hash, so a venv's ninja (PyPI's, 1.13) and Debian's (1.11) each find
    the other's builds stale: processes that found one and then the other rebuilt DeepSpeed's ops every time (five
    rebuilds of ~35 s in one slow-tier run here). Ray's processes find the venv's first
    (`service.backends.ray_local.head_environment`); the warm-up and the tests do the same.
    """
    from service.backends.ray_local import interpreter_bin_first

    os.environ["PATH"] = interpreter_bin_first(os.environ.get("PATH", ""))


def warm(ops: list[str]) -> dict[str, float]:
    """Load (and so build, if not cached) each op; return seconds taken per op."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    taken: dict[str, float] = {}
    for op in ops:
        started = time.monotonic()
        builder = accelerator.create_op_builder(OPS[op])
        if builder is None or not builder.is_compatible():
            log.info("skipping %s: not available on accelerator %s", op, accelerator.device_name())
            continue
        builder.load()
        taken[op] = time.monotonic() - started
        log.info("%s ready in %.1f s", op, taken[op])
    return taken


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ops", nargs="*", default=["shm_comm"], choices=sorted(OPS), help="ops to build")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    use_interpreter_bin_first()
    warm(args.ops)
    return 0


if __name__ == "__main__":
    sys.exit(main())
