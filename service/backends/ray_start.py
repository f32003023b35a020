"""`ray start`, with shunter's worker launcher in the place of Ray's set-up step: `python -m service.backends.ray_start
--head ...` takes `ray start`'s own arguments.

The raylet of a node started so starts each worker process through `workers/launch_worker.py`, which does what
Ray's `setup_worker.py` does without importing Ray first (about 0.5 CPU-seconds less for every actor of every attempt;
see that module). Everything else is Ray's `ray start`, unchanged. `service.backends.ray_local` starts its heads this
way; a cluster an operator starts with Ray's own `ray start` runs Ray's own set-up step.
"""

from __future__ import annotations

import sys
from pathlib import Path

LAUNCHER = str(Path(__file__).resolve().parents[2] / "workers" / "launch_worker.py")


def use_launcher() -> None:
    """Make the nodes this process starts use `LAUNCHER`: Ray joins `SETUP_WORKER_FILENAME` to its own workers
    directory when it builds a raylet's worker command (`ray._private.node.Node`), and an absolute path replaces it."""
    import ray._private.ray_constants as constants

    constants.SETUP_WORKER_FILENAME = LAUNCHER


def main() -> int:
    use_launcher()
    from ray.scripts.scripts import main as ray_main

    sys.argv = ["ray", "start", *sys.argv[1:]]
    return ray_main() or 0


if __name__ == "__main__":
    sys.exit(main())
