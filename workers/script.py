"""Script mode: run an unchanged torchrun-style script in every Ray Train worker.

Each worker starts the script as a child process with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID, ...), so the script's own
`dist.init_process_group("gloo"|"nccl")` with env:// rendezvous works, across nodes too. A child process, because
Ray Train already holds a process group in the worker and a second `init_process_group` there would fail. The
rendezvous uses a fresh port on rank 0's node: Ray's own MASTER_PORT is taken by its store.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from workers.context import locate

TORCHRUN_VARS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
)  # fmt: skip


def launch_dir(given: str, resolved: Path) -> str:
    """The directory under which `given` (a relative script path) names `resolved`; the cwd for anything else."""
    relative = Path(given)
    if relative.is_absolute() or len(resolved.parts) <= len(relative.parts):
        return os.getcwd()
    root = Path(*resolved.parts[: len(resolved.parts) - len(relative.parts)])
    return str(root) if (root / relative).resolve() == resolved else os.getcwd()


def resolve_script(script: str) -> Path:
    """The script's path (see `workers.context.locate`)."""
    return locate(script, field="entrypoint.script")


def _free_port(address: str) -> int:
    with socket.socket() as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:
    # If the Ray worker is killed (group abort, node loss), the script must not live on holding the rendezvous.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def torchrun_environment(*, master_addr: str, master_port: int, run_id: str) -> dict[str, str]:
    """This worker's torch elastic environment, from Ray Train's view of the worker group."""
    import ray.train

    ctx = ray.train.get_context()
    world_size, local_world_size = ctx.get_world_size(), ctx.get_local_world_size()
    env = dict(os.environ)
    env.update(
        RANK=str(ctx.get_world_rank()),
        LOCAL_RANK=str(ctx.get_local_rank()),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(local_world_size),
        GROUP_RANK=str(ctx.get_node_rank()),
        NODE_RANK=str(ctx.get_node_rank()),
        GROUP_WORLD_SIZE=str(max(1, world_size // max(1, local_world_size))),
        ROLE_RANK=str(ctx.get_world_rank()),
        ROLE_WORLD_SIZE=str(world_size),
        ROLE_NAME="default",
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        TORCHELASTIC_RUN_ID=run_id,
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
        PYTHONUNBUFFERED="1",
    )
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default; without it threads oversubscribe the node
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)
    return env


def run_script(config: dict[str, Any]) -> None:
    """Ray Train loop for `entrypoint.script`: the script's exit code decides; its output goes to the job's logs."""
    import ray.train
    from ray.train.collective import broadcast_from_rank_zero
    from ray.util import get_node_ip_address

    from workers.context import job_id

    ctx = ray.train.get_context()
    script = resolve_script(config["script"])
    rendezvous = None
    if ctx.get_world_rank() == 0:
        address = get_node_ip_address()
        rendezvous = (address, _free_port(address))
    master_addr, master_port = broadcast_from_rank_zero(rendezvous)
    run_id = job_id() or ctx.get_experiment_name()
    env = torchrun_environment(master_addr=master_addr, master_port=master_port, run_id=run_id)
    command = [sys.executable, "-u", str(script), *map(str, config.get("args", []))]
    # Run from the directory the script's relative path was found under (the checkout, or the job's working_dir),
    # as `torchrun examples/x.py --config examples/c.json` runs from the repo root: its relative args resolve.
    cwd = launch_dir(config["script"], script)
    print(f"[shunter] rank {env['RANK']}/{env['WORLD_SIZE']}: {' '.join(command)}", flush=True)
    proc = subprocess.Popen(
        command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
    )
    try:
        assert proc.stdout is not None
        for line in iter(proc.stdout.readline, b""):
            sys.stdout.write(line.decode(errors="replace"))
            sys.stdout.flush()
        code = proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if code != 0:
        raise RuntimeError(f"script {config['script']} exited with code {code} on rank {env['RANK']}")
