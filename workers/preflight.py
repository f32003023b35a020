"""The check every worker group runs before the job's own code starts (the spec's `preflight`, on by default).

A bad NIC, GPU or host usually shows as the first all-reduce hanging for the collective timeout (30 minutes by
default), and then again on the retry, on the same node. This check finds it in seconds, before any training, and
names the rank, node and address at fault so the retry can keep off it (`service.policy.exclusion`):

1. facts: each rank publishes what it runs on (node, address, device, free memory, driver; CPU cores on CPU) in the
   process group's own key-value store, which needs no collective and so still works when one would hang;
2. rendezvous: how long until every rank has published (a rank that never does is named);
3. all-reduce of a known tensor (rank r sends r + 1 everywhere), checked for the right sum on every rank, and every
   rank's own contribution checked, so a wrong sum names the rank that sent the wrong value;
4. a short bandwidth measure of all-reduce, and of point-to-point between neighbours (r -> r + 1), and a per-rank
   compute probe: a rank slower than `slow_factor` x the median of the others fails the attempt on GPUs and only warns
   on CPU, where a shared machine is noisy.

Every collective runs with `timeout_seconds`, polled, so a hang fails fast; before each one a rank marks in the store
that it arrived, so a rank that never joined is named rather than the ones left waiting for it. Rank 0 sends the
result to shunter (the attempt's `preflight`); on a failure every rank that saw it sends it (the first one is kept)
and raises `PreflightFailed`, which the driver records as `preflight_failed`.

`SHUNTER_PREFLIGHT_INJECT` (error | hang | wrong_sum | slow) makes this rank fail the check on purpose; it is read here
only, for tests that set it on one node of a cluster (Ray passes a node's environment to its workers).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import statistics
import time
from datetime import timedelta
from typing import Any

log = logging.getLogger("shunter.preflight")

INJECT_ENV = "SHUNTER_PREFLIGHT_INJECT"
PREFIX = "shunter/preflight"
ALLREDUCE_BYTES = {"cpu": 4 << 20, "cuda": 64 << 20}  # the bandwidth probes' sizes
P2P_BYTES = {"cpu": 4 << 20, "cuda": 64 << 20}
REPEATS = 3  # timed repetitions of each probe, after one warm-up; the fastest counts (least noise)
MAX_RANKS_LISTED = 128  # larger groups list only the ranks that failed or were slow (the report stays small)
REPORT_PATIENCE_SECONDS = 10.0


class PreflightFailed(RuntimeError):
    """A rank failed the check; the message names the rank, its node (`node_id='…'`) and address."""


def run(options: dict[str, Any]) -> dict[str, Any] | None:
    """Run the check on this rank (inside a Ray Train worker, process group set up) and return the report; rank 0
    sends it to shunter. Raises `PreflightFailed` when any rank failed it. None when the check is turned off."""
    if not options.get("enabled", True):
        return None
    import ray.train

    ctx = ray.train.get_context()
    check = _Check(
        rank=ctx.get_world_rank(), world=ctx.get_world_size(), local_rank=ctx.get_local_rank(),
        timeout=float(options.get("timeout_seconds", 60.0)), slow_factor=float(options.get("slow_factor", 4.0)),
    )  # fmt: skip
    report = check.run()
    if report["failed"] is not None:
        _send_failure(report)
        raise PreflightFailed(failure_message(report["failed"]))
    if check.rank == 0:  # a pass is news the first step need not wait for (a failure is sent before the raise)
        from workers.attempt_api import in_background
        from workers.context import attempt_api

        api = attempt_api()
        if api is not None:
            in_background(api, lambda a: a.preflight(report, patience=REPORT_PATIENCE_SECONDS), "the pre-flight result")
    for warning in report["warnings"]:
        log.warning("shunter: pre-flight: %s", warning)
    return report


def failure_message(failed: dict[str, Any]) -> str:
    where = f"node_id='{failed.get('node_id') or 'unknown'}' ({failed.get('address') or 'address unknown'})"
    return f"pre-flight check failed: rank {failed.get('rank')} on {where}: {failed.get('why')}"


def _send_failure(report: dict[str, Any]) -> None:
    """Every rank that saw the failure sends it, before raising: the attempt's end reads where it failed."""
    try:
        from workers.context import attempt_api

        api = attempt_api()
        if api is not None:
            api.preflight(report, patience=REPORT_PATIENCE_SECONDS)
    except Exception:  # noqa: BLE001 - the result is in the log; a lost report must not fail (or pass) the attempt
        log.exception("shunter: could not send the pre-flight result (every rank sends a failure)")


class _Check:
    def __init__(self, *, rank: int, world: int, local_rank: int, timeout: float, slow_factor: float) -> None:
        self.rank, self.world, self.local_rank = rank, world, local_rank
        self.timeout, self.slow_factor = timeout, slow_factor
        self.inject = os.environ.get(INJECT_ENV, "")
        self.started = time.monotonic()
        self.facts: list[dict[str, Any] | None] = [None] * world
        self._failed: dict[str, Any] | None = None

    def run(self) -> dict[str, Any]:
        import torch.distributed as dist

        mine = self._my_facts()
        report: dict[str, Any] = {
            "ok": True, "seconds": 0.0, "world_size": self.world, "backend": "none", "rendezvous_seconds": 0.0,
            "allreduce_seconds": None, "allreduce_gbps": None, "p2p_gbps": None, "ranks": [], "slow": [],
            "failed": None, "warnings": [],
        }  # fmt: skip
        self.facts[self.rank] = mine
        try:
            if self.world > 1 and dist.is_available() and dist.is_initialized():
                report["backend"] = str(dist.get_backend())
                self._collectives(report)
            else:
                mine["compute_seconds"] = self._compute_probe()
        except PreflightFailed as exc:  # this rank's own finding, as `_fail` (or `_hung`) recorded it
            report["failed"] = self._failed or {**self._where(self.rank), "why": str(exc)}
        except Exception as exc:  # noqa: BLE001 - this rank could not run the check: it is the one at fault
            report["failed"] = {**self._where(self.rank), "why": f"the check raised {type(exc).__name__}: {exc}"}
        report["ok"] = report["failed"] is None
        report["seconds"] = round(time.monotonic() - self.started, 4)
        listed = [f for f in self.facts if f is not None]
        if self.world > MAX_RANKS_LISTED:
            named = {s["rank"] for s in report["slow"]} | {(report["failed"] or {}).get("rank")}
            listed = [f for f in listed if f["rank"] in named]
        report["ranks"] = listed
        return report

    # ---- facts, through the store ------------------------------------------------------------------------------
    def _my_facts(self) -> dict[str, Any]:
        import ray
        import torch

        facts: dict[str, Any] = {"rank": self.rank, "local_rank": self.local_rank, "hostname": socket.gethostname(),
                                 "pid": os.getpid(), "cpus": os.cpu_count()}  # fmt: skip
        facts["node_id"], facts["address"] = None, None  # outside Ray (a plain process group): no node to name
        if ray.is_initialized():  # asking an uninitialised Ray would start one
            with contextlib.suppress(Exception):
                facts["node_id"] = ray.get_runtime_context().get_node_id()
                facts["address"] = ray.util.get_node_ip_address()
        with contextlib.suppress(AttributeError, OSError):
            facts["cpus_usable"] = len(os.sched_getaffinity(0))
        facts["mem_available_gb"] = _mem_available_gb()
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            device = torch.cuda.current_device()
            free, total = torch.cuda.mem_get_info(device)
            facts.update(device=f"cuda:{device}", gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                         gpu_free_gb=round(free / 2**30, 3), gpu_total_gb=round(total / 2**30, 3),
                         driver=_nvidia_driver())  # fmt: skip
        else:
            facts["device"] = "cpu"
        return facts

    def _where(self, rank: int | None) -> dict[str, Any]:
        facts = self.facts[rank] if rank is not None and 0 <= rank < self.world else None
        return {"rank": rank, "node_id": (facts or {}).get("node_id"), "address": (facts or {}).get("address")}

    def _store(self) -> Any:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()  # the process group's rendezvous store (TCPStore)

    def _key(self, *parts: object) -> str:
        return "/".join([PREFIX, *(str(p) for p in parts)])

    def _exchange(self, store: Any, kind: str, mine: dict[str, Any]) -> list[dict[str, Any]]:
        """Publish this rank's `mine` under `kind` and read every rank's; a rank that never publishes is named."""
        store.set(self._key(kind, self.rank), json.dumps(mine))
        keys = [self._key(kind, r) for r in range(self.world)]
        try:
            store.wait(keys, timedelta(seconds=self.timeout))
        except Exception as exc:  # noqa: BLE001 - a store timeout: who never published?
            missing = [r for r in range(self.world) if not store.check([keys[r]])]
            if not missing:
                raise
            what = "reached the check" if kind == "facts" else f"sent its {kind}"
            raise self._fail(missing[0], f"never {what} within {self.timeout:g}s (ranks missing: {missing})") from exc
        return [mine if r == self.rank else json.loads(store.get(keys[r])) for r in range(self.world)]

    def _fail(self, rank: int, why: str) -> PreflightFailed:
        self._failed = {**self._where(rank), "why": why}
        return PreflightFailed(failure_message(self._failed))

    # ---- the collectives ---------------------------------------------------------------------------------------
    def _collectives(self, report: dict[str, Any]) -> None:
        store = self._store()
        self.facts = list(self._exchange(store, "facts", self.facts[self.rank] or {}))
        report["rendezvous_seconds"] = round(time.monotonic() - self.started, 4)
        device = self._device()
        self._check_sum(store, device)
        compute = self._compute_probe(device)
        report["allreduce_seconds"], report["allreduce_gbps"] = self._allreduce_bandwidth(store, device)
        p2p = self._p2p(store, device)
        try:
            self._gather_timings(store, compute, p2p, report)
        finally:
            self._leave(store)

    def _device(self) -> Any:
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _wait(self, store: Any, work: Any, phase: str) -> None:
        """Wait for a collective up to the timeout; a hang names a rank that never arrived when there is one.

        gloo's works take a timeout (its send and receive ones never say they completed until waited on); NCCL's are
        polled, since their `wait` only orders the GPU stream."""
        import torch.distributed as dist

        if dist.get_backend() == "gloo":
            try:
                work.wait(timedelta(seconds=self.timeout))
                return
            except RuntimeError as exc:
                timed_out = "timed out" in str(exc).lower() or "timeout" in str(exc).lower()
                self._hung(store, phase, None if timed_out else exc)
        deadline = time.monotonic() + self.timeout
        while not work.is_completed():
            if time.monotonic() > deadline:
                self._hung(store, phase)
            time.sleep(0.001)
        try:
            work.wait()  # raises what the collective raised
        except RuntimeError as exc:
            self._hung(store, phase, exc)

    def _hung(self, store: Any, phase: str, error: BaseException | None = None) -> None:
        """Name who is at fault for a collective that timed out or (`error`) failed: a rank that never joined it
        (it hung or failed before); with every rank in it, a timeout names none, and an error is raised as it is."""
        absent = [r for r in range(self.world) if not store.check([self._key("at", phase, r)])]
        if absent:
            how = f"within {self.timeout:g}s" if error is None else f"(the others' {phase} failed: {str(error)[:200]})"
            raise self._fail(absent[0], f"did not join the {phase} {how} (ranks missing: {absent})")
        if error is not None:
            raise error
        self._failed = {"rank": None, "node_id": None, "address": None,
                        "why": f"the {phase} hung for {self.timeout:g}s with every rank in it"}  # fmt: skip
        raise PreflightFailed(f"pre-flight check failed: {self._failed['why']}")

    def _arrive(self, store: Any, phase: str) -> None:
        if self.inject == "hang" and phase == "all-reduce":
            time.sleep(self.timeout * 3)  # stuck before it joins (a hung device, a wedged host): the others name it
        store.set(self._key("at", phase, self.rank), "1")

    def _check_sum(self, store: Any, device: Any) -> None:
        import torch
        import torch.distributed as dist

        if self.inject == "error":
            raise RuntimeError(f"{INJECT_ENV}=error")
        sent = float(self.rank + 1) + (1000.0 if self.inject == "wrong_sum" else 0.0)
        tensor = torch.full((1024,), sent, dtype=torch.float32, device=device)
        gathered = [torch.zeros(1, dtype=torch.float32, device=device) for _ in range(self.world)]
        self._arrive(store, "all-reduce")
        self._wait(store, dist.all_reduce(tensor, async_op=True), "all-reduce")
        mine = tensor.new_full((1,), sent)  # kept referenced until the gather completes
        self._arrive(store, "all-gather")
        self._wait(store, dist.all_gather(gathered, mine, async_op=True), "all-gather")
        expected = self.world * (self.world + 1) / 2
        wrong = [r for r, g in enumerate(gathered) if float(g.item()) != float(r + 1)]
        if wrong:
            r = wrong[0]
            raise self._fail(r, f"sent {float(gathered[r].item()):g} to the all-reduce instead of {r + 1}: "
                                f"the sum is {float(tensor[0].item()):g}, not {expected:g}")  # fmt: skip
        if not bool(torch.all(tensor == expected).item()):
            raise self._fail(self.rank, f"got {float(tensor[0].item()):g} from the all-reduce, not {expected:g}")

    def _compute_probe(self, device: Any = None) -> float:
        """The fastest of a few small matmuls on this rank's device: a throttled GPU or a starved host shows here."""
        import torch

        device = device or torch.device("cpu")
        a = torch.randn(256, 256, device=device)
        best = float("inf")
        for i in range(REPEATS + 1):
            began = time.perf_counter()
            (a @ a).sum().item()
            if self.inject == "slow":
                time.sleep(0.2)
            if i:
                best = min(best, time.perf_counter() - began)
        return round(best, 6)

    def _allreduce_bandwidth(self, store: Any, device: Any) -> tuple[float, float]:
        import torch
        import torch.distributed as dist

        size = ALLREDUCE_BYTES[device.type] // 4
        tensor = torch.ones(size, dtype=torch.float32, device=device)
        best = float("inf")
        for i in range(REPEATS + 1):
            phase = f"bandwidth all-reduce {i}"
            self._arrive(store, phase)
            began = time.perf_counter()
            self._wait(store, dist.all_reduce(tensor, async_op=True), phase)
            if i:
                best = min(best, time.perf_counter() - began)
        # Bus bandwidth, as nccl-tests count it: each rank moves 2 (n - 1) / n of the buffer.
        moved = 2 * (self.world - 1) / self.world * size * 4
        return round(best, 6), round(moved / best / 1e9, 4)

    def _p2p(self, store: Any, device: Any) -> float:
        """The fastest exchange with the neighbours: send to rank + 1, receive from rank - 1 (a ring)."""
        import torch
        import torch.distributed as dist

        size = P2P_BYTES[device.type] // 4
        out = torch.ones(size, dtype=torch.float32, device=device)
        into = torch.empty(size, dtype=torch.float32, device=device)
        right, left = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        best = float("inf")
        for i in range(REPEATS + 1):
            phase = f"point-to-point {i}"
            self._arrive(store, phase)
            began = time.perf_counter()
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, right), dist.P2POp(dist.irecv, into, left)])
            for work in works:
                self._wait(store, work, phase)
            if self.inject == "slow":
                time.sleep(0.2)
            if i:
                best = min(best, time.perf_counter() - began)
        return round(best, 6)

    def _leave(self, store: Any) -> None:
        """Rank 0 hosts the store: it waits (up to the timeout) until every rank has read what it needs from it, so
        a rank 0 that ends right after the check (a failing first step, a test process) fails no one's check."""
        store.set(self._key("done", self.rank), "1")
        if self.rank == 0:
            with contextlib.suppress(Exception):  # a rank that never gets here has already failed its own check
                store.wait([self._key("done", r) for r in range(self.world)], timedelta(seconds=self.timeout))

    def _gather_timings(self, store: Any, compute: float, p2p: float, report: dict[str, Any]) -> None:
        """Every rank's timings through the store; ranks slower than `slow_factor` x the others' median."""
        mine = {"compute_seconds": compute, "p2p_seconds": p2p, "rendezvous_seconds": report["rendezvous_seconds"]}
        timings = self._exchange(store, "timings", mine)
        for r, t in enumerate(timings):
            self.facts[r] = {**(self.facts[r] or {"rank": r}), **t}
        report["p2p_gbps"] = round(P2P_BYTES[self._device().type] / max(statistics.median(
            t["p2p_seconds"] for t in timings), 1e-9) / 1e9, 4)  # fmt: skip
        for what in ("compute_seconds", "p2p_seconds"):
            values = [t[what] for t in timings]
            for r, value in enumerate(values):
                others = values[:r] + values[r + 1 :]
                typical = statistics.median(others) if others else value
                if typical > 0 and value > self.slow_factor * typical:
                    factor = round(value / typical, 2)
                    report["slow"].append({**self._where(r), "what": what.removesuffix("_seconds"), "factor": factor})
        gpu = self._device().type == "cuda"
        for slow in report["slow"]:
            why = (f"is {slow['factor']:g}x slower than the median of the others at {slow['what']} "
                   f"(slow_factor {self.slow_factor:g})")  # fmt: skip
            if gpu:
                raise self._fail(slow["rank"], why)
            where = f"rank {slow['rank']} on node {slow['node_id']} ({slow['address']})"
            report["warnings"].append(f"{where} {why}; on CPU this only warns")


def _mem_available_gb() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return round(int(line.split()[1]) / 2**20, 3)
    except OSError:
        pass
    return None


def _nvidia_driver() -> str | None:
    try:
        with open("/proc/driver/nvidia/version") as f:
            first = f.readline()
        parts = [p for p in first.split() if p[:1].isdigit() and "." in p]
        return parts[0] if parts else None
    except OSError:
        return None
