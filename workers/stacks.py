"""Every rank's Python stack on demand, without ptrace: faulthandler on SIGUSR1.

shunter's train workers (`workers.train_loop.run_loop`) and script processes (`workers/script_site/sitecustomize.py`)
register faulthandler for SIGUSR1 (`register`). It prints every thread's stack to the process's stderr from a C signal
handler, so it answers even while the loop is stuck in a blocking call. A train worker's stderr is forwarded by Ray to
the attempt's driver (`ray.init(log_to_driver=True)` in `workers.driver`), so the stacks land in the attempt's Ray Job
log, which the dispatcher keeps when the attempt ends; a script process's stderr goes out through its train worker
(`workers.script`), the same way.

`python -m workers.stacks --ray-job-id <hex> --job-id <shunter job id>` is the Ray Job the dispatcher submits for a
stalled attempt (`service.backends.ray_jobs.RayJobs.dump_stacks`; the control plane holds no Ray driver of its own). It
lists the attempt's live `RayTrainWorker` actors and runs a task on each of their nodes that signals them, and each
child of one that belongs to the same shunter job (a script process: `SHUNTER_JOB_ID` in its environment). SIGUSR1's
default action ends a process, so a process is signalled only when the kernel shows it catching SIGUSR1 (`SigCgt` in
/proc/<pid>/status): one that never registered the handler is left alone, never killed. Its last output line (`SAID`)
says what it did; the dispatcher puts it in the attempt's end message.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
from pathlib import Path

from service.policy.stall import DUMP_SAID as SAID  # the summary line's prefix, read back by the dispatcher

TASK_SECONDS = 60.0


def register() -> None:
    """Print every thread's stack to stderr on SIGUSR1. Idempotent (a restarted loop in the same worker registers
    again, to the same effect); never raises: a loop without it only loses its stacks on a stall."""
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    except (AttributeError, ValueError, OSError, RuntimeError) as exc:  # no SIGUSR1 here, or no usable stderr
        print(f"shunter: no stack dump on SIGUSR1 for this process: {type(exc).__name__}: {exc}", file=sys.stderr)


def catches(pid: int, sig: int = signal.SIGUSR1, proc: Path = Path("/proc")) -> bool:
    """Whether process `pid` has a handler for `sig` (its `SigCgt` mask): only then is it safe to send it."""
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def children_of(pid: int, job_id: str, proc: Path = Path("/proc")) -> list[int]:
    """The child processes of `pid` that belong to shunter job `job_id` (`SHUNTER_JOB_ID` in their environment)."""
    marker = f"SHUNTER_JOB_ID={job_id}".encode()
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            parent = int(stat[stat.rindex(")") + 2 :].split()[1])  # after "pid (comm) state": the parent's pid
            if parent == pid and marker in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not ours to read
            continue
    return sorted(found)


def signal_ranks(pids: list[int], job_id: str) -> list[str]:
    """On one node: ask each train worker of `pids`, and each child of one that belongs to `job_id`, for its stack;
    one line per process saying what was done."""
    lines = []
    for worker in pids:
        for pid in [worker, *children_of(worker, job_id)]:
            kind = "train worker" if pid == worker else f"child of {worker}"
            if not catches(pid):
                lines.append(f"pid {pid} ({kind}): left alone, it does not catch SIGUSR1")
                continue
            try:
                os.kill(pid, signal.SIGUSR1)
                lines.append(f"pid {pid} ({kind}): stack asked for")
            except OSError as exc:  # ended meanwhile
                lines.append(f"pid {pid} ({kind}): {type(exc).__name__}: {exc}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.stacks", description=__doc__.splitlines()[0])
    parser.add_argument("--ray-job-id", required=True, help="the attempt's Ray job id (hex)")
    parser.add_argument("--job-id", required=True, help="the shunter job id (marks its script processes)")
    args = parser.parse_args(argv)

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    from ray.util.state import list_actors

    from workers.stacks import signal_ranks as on_node  # by reference: this file runs as __main__ here

    ray.init(log_to_driver=False)
    actors = list_actors(filters=[("job_id", "=", args.ray_job_id), ("state", "=", "ALIVE")], limit=10_000,
                         raise_on_missing_output=False)  # fmt: skip
    by_node: dict[str, list[int]] = {}
    for actor in actors:
        if "RayTrainWorker" in (actor.class_name or "") and actor.node_id and actor.pid:
            by_node.setdefault(actor.node_id, []).append(int(actor.pid))
    task = ray.remote(num_cpus=0, max_retries=0)(on_node)
    refs = {}
    for node, pids in by_node.items():  # on that node and no other: a pid means nothing elsewhere
        pinned = task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
        refs[node] = pinned.remote(pids, args.job_id)
    asked = 0
    for node, ref in refs.items():
        try:
            lines = ray.get(ref, timeout=TASK_SECONDS)
        except Exception as exc:  # noqa: BLE001 - a node that cannot be reached: say so, ask the others
            lines = [f"{type(exc).__name__}: {exc}"]
        for line in lines:
            print(f"node {node[:12]}: {line}", flush=True)
        asked += sum(line.endswith("stack asked for") for line in lines)
    workers = sum(len(p) for p in by_node.values())
    print(f"{SAID} asked {asked} process(es) for their stack: {workers} train worker(s) of Ray job "
          f"{args.ray_job_id} on {len(by_node)} node(s)", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
