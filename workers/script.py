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
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from workers import drain
from workers.context import locate

log = logging.getLogger(__name__)
# Signals that end a script from outside it: its worker is lost, which is retried; a crash of its own (SIGSEGV,
# SIGABRT, ...) or a non-zero exit is the script's error.
KILLED_BY = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGHUP})


class ScriptKilledError(RuntimeError):
    """The script's process was killed by a signal from outside (`KILLED_BY`): its worker counts as lost."""


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


def rendezvous_port() -> int:
    """A port for the script's rendezvous on rank 0's node, which the script's process binds seconds later (Python and
    torch start first). Picked below the kernel's ephemeral range (`service.backends.ray_local.free_port`), where no
    outgoing connection or port-0 bind is handed it meanwhile; a port picked by binding port 0 came from that very
    range, open to any socket of the node until the script bound it."""
    from service.backends.ray_local import free_port

    return free_port()


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


ENV_OUTPUT_DIR = "SHUNTER_OUTPUT_DIR"  # the script's own output folder: its content is kept in <storage>/<job>/outputs
ENV_SCRIPT_CONTROL = "SHUNTER_SCRIPT_CONTROL"  # where the script's process leaves word for shunter (markers)
ENV_RUN_ROOT = "SHUNTER_RUN_ROOT"  # where attempts' run folders go on a node (default: the temp dir)
MARKER_POLL_SECONDS = 1.0


@dataclass(frozen=True)
class RunLayout:
    """This attempt's folders on one node, shared by its ranks there: `cwd` (the script's working directory when the
    job names `outputs`), `output` (SHUNTER_OUTPUT_DIR) and `control` (SHUNTER_SCRIPT_CONTROL)."""

    root: Path

    @classmethod
    def of(cls, job: str, attempt: int, node: str = "") -> RunLayout:
        """`<run root>/shunter-runs/<node>/<job>/a<attempt>`, `node` being the node's IP: Ray Train numbers local
        ranks per node IP, so the workers that share a local rank 0 (which makes the folders) share the folder, and
        two nodes on one host with their own IPs (a test cluster on 127.0.0.x) are kept apart as two hosts are."""
        node = re.sub(r"[^A-Za-z0-9_.-]", "_", node)[:64] or "node"
        base = Path(os.environ.get(ENV_RUN_ROOT) or tempfile.gettempdir()) / "shunter-runs" / node
        return cls(base / re.sub(r"[^A-Za-z0-9_.-]", "_", job)[:128] / f"a{attempt}")

    @property
    def cwd(self) -> Path:
        return self.root / "cwd"

    @property
    def output(self) -> Path:
        return self.root / "output"

    @property
    def control(self) -> Path:
        return self.root / "control"

    def prepare(self, launch: str | None, outputs: list[str]) -> None:
        """Make the folders (once per node: local rank 0). Earlier attempts' folders of the job go: what they kept is
        in storage. With `launch`, `cwd` mirrors it: a link to each entry, and real folders for the `outputs`."""
        for older in self.root.parent.glob("a*"):
            if older != self.root and older.name[1:].isdigit() and int(older.name[1:]) < int(self.root.name[1:]):
                shutil.rmtree(older, ignore_errors=True)
        shutil.rmtree(self.control, ignore_errors=True)  # markers of a run before (a restarted worker group)
        for folder in (self.output, self.control / "saved"):
            folder.mkdir(parents=True, exist_ok=True)
        if launch is not None:
            _shadow(Path(launch), self.cwd, [PurePosixPath(o).parts for o in outputs])
            for name in outputs:
                (self.cwd / name).mkdir(parents=True, exist_ok=True)


def _shadow(source: Path, target: Path, outputs: list[tuple[str, ...]]) -> None:
    """`target` as a view of `source`: each entry a symlink to the original, except the output folders (and the
    folders above them), which are real, so what the script writes into them is this attempt's own."""
    target.mkdir(parents=True, exist_ok=True)
    for entry in source.iterdir():
        below = [parts[1:] for parts in outputs if parts and parts[0] == entry.name]
        link = target / entry.name
        if below:
            if not any(len(parts) == 0 for parts in below) and entry.is_dir() and not entry.is_symlink():
                _shadow(entry, link, below)  # a folder above an output: mirror it one level deeper
            continue  # an output folder itself: made empty (or put back from storage), never linked
        if not link.exists() and not link.is_symlink():
            with contextlib.suppress(FileExistsError):  # another rank of this node got there first
                link.symlink_to(entry)


def outputs_uri_of(job: str) -> str | None:
    """`<storage>/<job>/outputs`, where a job's outputs are kept; None outside shunter (no job storage)."""
    storage = os.environ.get("SHUNTER_JOB_STORAGE")
    return f"{storage.rstrip('/')}/{job}/outputs" if storage else None


def restore_outputs(outputs_uri: str, roots: dict[str, Path]) -> Path | None:
    """Put back what storage keeps of the outputs (a retry, or a restarted worker group on this node) and drop local
    checkpoint folders storage does not hold complete (a restarted group's half-written leftovers); the newest
    complete checkpoint folder, or None."""
    from workers import manifest
    from workers.outputs import restore
    from workers.storage import filesystem_for

    newest = restore(outputs_uri, roots)
    path, filesystem = filesystem_for(outputs_uri)
    for name, root in roots.items():
        if not root.is_dir():
            continue
        for local in (p for p in root.iterdir() if p.is_dir() and not p.is_symlink()):
            stored = "/".join(part for part in (path.rstrip("/"), name, local.name) if part)
            if not manifest.check(stored, filesystem).manifest:
                log.warning("shunter: %s is not kept complete in storage; removed before the script starts", local)
                shutil.rmtree(local, ignore_errors=True)
    return newest


class _Syncer:
    """The node's output syncer, and the watcher of the script's "saved" markers (HF Trainer's on_save)."""

    def __init__(self, sync: Any, control: Path, local_ranks: int) -> None:
        self.sync, self.control, self.local_ranks = sync, control, local_ranks
        self._seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="shunter-saved-markers", daemon=True)
        self.sync.start()
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(MARKER_POLL_SECONDS):
            self._marks()

    def _marks(self) -> None:
        from workers.script_progress import saved_checkpoints

        try:
            for name, path in saved_checkpoints(self.control, self.local_ranks).items():
                if name not in self._seen:
                    self._seen.add(name)
                    self.sync.mark_saved(path)
        except OSError:
            log.exception("shunter: could not read the script's saved markers")

    def stop(self, *, final: bool) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._marks()
        self.sync.stop(final=final)


def node_count() -> int:
    """How many nodes this worker group spans (every rank must call it: a collective when torch's group is up)."""
    import ray.train

    ctx = ray.train.get_context()
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            ranks: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, ctx.get_node_rank())
            return len(set(ranks))
    except Exception:  # noqa: BLE001 - fall back to Ray Train's view, exact for an even placement
        log.exception("shunter: could not count the nodes of the worker group")
    return max(1, ctx.get_world_size() // max(1, ctx.get_local_world_size()))


def start_syncer(outputs_uri: str, roots: dict[str, Path], layout: RunLayout, *, nodes: int) -> _Syncer:
    """The node's syncer (local rank 0). The one on rank 0's node seals checkpoint folders and lists them."""
    import ray.train

    from workers import context
    from workers.output_sync import OutputSync

    ctx = ray.train.get_context()
    leader = ctx.get_world_rank() == 0
    api = context.attempt_api() if leader else None

    def listed(uri: str, step: int | None) -> None:
        if api is not None:
            api.checkpoint(uri, step=step, patience=CHECKPOINT_PATIENCE_SECONDS)

    sync = OutputSync(roots, outputs_uri, node_rank=ctx.get_node_rank(), nodes=nodes, leader=leader,
                      attempt=context.attempt(), on_checkpoint=listed)  # fmt: skip
    return _Syncer(sync, layout.control, ctx.get_local_world_size())


CHECKPOINT_PATIENCE_SECONDS = 10.0


def script_environment(layout: RunLayout) -> dict[str, str]:
    """What shunter adds to the script's environment: its output folder, its control folder, and the folder whose
    `sitecustomize` hooks HF `Trainer` (first on PYTHONPATH; it hands over to any other `sitecustomize`)."""
    from workers.script_progress import SITE_DIR

    return {ENV_OUTPUT_DIR: str(layout.output), ENV_SCRIPT_CONTROL: str(layout.control), "PYTHONPATH": str(SITE_DIR)}


def stdout_progress(layout: RunLayout) -> Any:
    """Rank 0's reader of the script's output lines (JSON with a `step`, HF's log dicts) into progress reports."""
    from workers import context
    from workers.script_progress import StdoutProgress

    return StdoutProgress(context.attempt_api(), control_dir=layout.control)


def run_script(config: dict[str, Any]) -> None:
    """Ray Train loop for `entrypoint.script`: the script's exit code decides; its output goes to the job's logs.

    Around the script: its outputs are put back from storage before it starts (a retry, or a restarted worker group)
    and kept in storage while it runs (`workers.outputs`, one syncer per node); the job is RUNNING once every rank's
    script process has started; rank 0's output lines and an HF `Trainer`'s logs become the job's progress
    (`workers.script_progress`, `workers.hf_callback`).
    """
    import ray.train
    from ray.train.collective import barrier, broadcast_from_rank_zero
    from ray.util import get_node_ip_address

    from workers import context
    from workers.progress import announce_started

    ctx = ray.train.get_context()
    rank, local_rank = ctx.get_world_rank(), ctx.get_local_rank()
    script = resolve_script(config["script"])
    job, attempt = context.job_id() or ctx.get_experiment_name(), context.attempt()
    layout = RunLayout.of(job, attempt, get_node_ip_address())
    outputs = [str(o) for o in config.get("outputs") or []]
    # Run from the directory the script's relative path was found under (the checkout, or the job's working_dir),
    # as `torchrun examples/x.py --config examples/c.json` runs from the repo root: its relative args resolve. With
    # `outputs`, from a directory of this attempt's own that mirrors it (layout.prepare), so what the script writes
    # there is this job's alone.
    launch = launch_dir(config["script"], script)
    if local_rank == 0:
        layout.prepare(launch if outputs else None, outputs)
    barrier()
    cwd = str(layout.cwd) if outputs else launch
    roots = {"": layout.output, **{name: Path(cwd) / name for name in outputs}}
    outputs_uri = outputs_uri_of(job)
    resume = None
    if local_rank == 0 and outputs_uri is not None:
        resume = restore_outputs(outputs_uri, roots)
    resume = broadcast_from_rank_zero(str(resume) if resume else None)
    nodes = node_count() if outputs_uri is not None else 1
    syncer = None
    if local_rank == 0 and outputs_uri is not None:
        syncer = start_syncer(outputs_uri, roots, layout, nodes=nodes)

    rendezvous = None
    if rank == 0:
        address = get_node_ip_address()
        rendezvous = (address, rendezvous_port())
    master_addr, master_port = broadcast_from_rank_zero(rendezvous)
    env = torchrun_environment(master_addr=master_addr, master_port=master_port, run_id=job)
    added = script_environment(layout)
    env.update({**added, "PYTHONPATH": os.pathsep.join(p for p in (added["PYTHONPATH"], env.get("PYTHONPATH")) if p)})
    args = [*map(str, config.get("args", []))]
    if resume and config.get("resume_arg"):
        args += [str(config["resume_arg"]), resume]
    command = [sys.executable, "-u", str(script), *args]
    print(f"[shunter] rank {env['RANK']}/{env['WORLD_SIZE']}: {' '.join(command)}", flush=True)
    proc = subprocess.Popen(
        command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
    )
    code = None
    progress = None
    watching = threading.Event()
    drain.watch_for_script(layout.control, watching)  # a drain notice, passed on to the script's Trainer callback
    try:
        announce_started()  # every rank's script process is up
        progress = stdout_progress(layout) if rank == 0 else None
        assert proc.stdout is not None
        for line in iter(proc.stdout.readline, b""):
            text = line.decode(errors="replace")
            sys.stdout.write(text)
            sys.stdout.flush()
            if progress is not None:
                progress.feed(text)
        if progress is not None:
            progress.close()  # its last points (the final loss) are recorded before the attempt's end is
        code = proc.wait()
        if code == 0 and outputs_uri is not None:
            barrier()  # every rank's script is done writing before the node's last sync (on failure Ray aborts)
    finally:
        watching.set()
        if progress is not None:
            progress.close(timeout=0)  # a no-op after the close above; after a failure, nothing more is sent
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if syncer is not None:
            # A clean exit means every folder it wrote is complete; after a failure only what the rules say is.
            syncer.stop(final=code == 0)
    if code is not None and -code in KILLED_BY:
        raise ScriptKilledError(f"script {config['script']} was killed by {signal.Signals(-code).name} on rank "
                                f"{env['RANK']} (from outside: the OOM killer, an operator, a lost host)")  # fmt: skip
    if code != 0:
        raise RuntimeError(f"script {config['script']} exited with code {code} on rank {env['RANK']}")
    stopped = drain.script_stopped(layout.control)
    if stopped is not None:  # its Trainer saved on a drain notice and ended training: the attempt stops here
        raise stopped
    if syncer is not None:
        shutil.rmtree(layout.root, ignore_errors=True)  # all of it is in storage now
