"""The fair gate in front of the API (api.gate, issue 35): its choices as a table on the gate itself, then what a
flooded API does for everyone else, over real HTTP on a live API and its database."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import httpx
import pytest
from sqlalchemy.engine import Engine

from api.gate import Full, Gate, Late, Place
from tests.conftest import in_a_loop_of_its_own, wait_for
from tests.live_api import live_api
from tests.service import conftest as service_fixtures

T = TypeVar("T")
db = service_fixtures.db  # the fixture: a SQLite file, or a fresh PostgreSQL database

# --- the gate's choices ---------------------------------------------------------------------------------------------

# capacity, what happens in order, and the order in which requests get their place. "A+" is a request of caller A
# entering (it waits when it may not take a place), "-A" gives back the oldest place A holds.
ORDERS = [
    # one place: a caller's line does not keep another caller waiting behind all of it; turn by turn
    (1, ["A+", "B+", "B+", "B+", "C+", "-A", "-B", "-C", "-B", "-B"], ["A", "B", "C", "B", "B"]),
    # free places are taken at once while one more stays free, or by a caller with nothing computing
    (4, ["A+", "A+", "A+", "B+"], ["A", "A", "A", "B"]),
    # the last place is kept for a caller with nothing computing: a newcomer finds it at once, the busy caller waits
    (3, ["A+", "A+", "A+", "B+"], ["A", "A", "B"]),
    (3, ["A+", "A+", "A+", "B+", "-A", "-B"], ["A", "A", "B", "A"]),
    # ...and takes it before a busier caller that waited longer
    (3, ["A+", "A+", "B+", "A+", "-B", "C+"], ["A", "A", "B", "C"]),
    # a caller back after a turn waits behind one that has not had its turn
    (1, ["A+", "B+", "A+", "C+", "-A", "-B", "-C"], ["A", "B", "C", "A"]),
]


async def settle() -> None:
    """Let every task that can run, run (a granted request resumes a few loop turns after its grant)."""
    for _ in range(50):
        await asyncio.sleep(0)


@pytest.mark.parametrize(("capacity", "steps", "granted"), ORDERS)
def test_who_gets_the_next_place(capacity: int, steps: list[str], granted: list[str]) -> None:
    async def run() -> list[str]:
        gate = Gate(capacity=capacity, waiting_per_caller=10, max_wait_seconds=30)
        held: dict[str, list[Place]] = {}
        order: list[str] = []

        async def enter(key: str) -> None:
            place = await gate.enter(key)
            order.append(key)
            held.setdefault(key, []).append(place)

        tasks = []
        for step in steps:
            if step.endswith("+"):
                tasks.append(asyncio.create_task(enter(step[0])))
            else:
                held[step[1]].pop(0).release()
            await settle()
        for task in tasks:
            task.cancel()
        return order

    assert in_a_loop_of_its_own(run) == granted


def test_a_caller_over_its_waiting_line_is_refused_at_once_and_others_are_not() -> None:
    async def run() -> None:
        gate = Gate(capacity=1, waiting_per_caller=2, max_wait_seconds=30)
        await gate.enter("A")
        waiting = [asyncio.create_task(gate.enter("A")) for _ in range(2)]
        await settle()
        with pytest.raises(Full):
            await gate.enter("A")
        other = asyncio.create_task(gate.enter("B"))
        await settle()
        assert gate.waiting("A") == 2 and gate.waiting("B") == 1 and gate.refused_full == 1
        for task in [*waiting, other]:
            task.cancel()

    in_a_loop_of_its_own(run)


def test_a_request_waits_no_longer_than_the_bound_and_leaves_no_trace() -> None:
    async def run() -> None:
        gate = Gate(capacity=1, waiting_per_caller=5, max_wait_seconds=0.05)
        held = await gate.enter("A")
        with pytest.raises(Late):
            await gate.enter("B")
        assert gate.waiting() == 0 and gate.refused_late == 1
        held.release()
        assert gate.computing() == 0
        (await gate.enter("B")).release()

    in_a_loop_of_its_own(run)


def test_a_client_that_leaves_gives_its_place_or_its_turn_back() -> None:
    async def run() -> None:
        gate = Gate(capacity=1, waiting_per_caller=5, max_wait_seconds=30)
        held = await gate.enter("A")
        leaving = asyncio.create_task(gate.enter("B"))
        await settle()
        leaving.cancel()  # while waiting: out of the line
        await settle()
        assert gate.waiting() == 0
        granted_then_gone = asyncio.create_task(gate.enter("C"))
        await settle()
        held.release()  # C's turn, given to a request that is cancelled before it runs: the place comes back
        granted_then_gone.cancel()
        await settle()
        assert gate.computing() == 0 and gate.waiting() == 0
        place = await gate.enter("A")
        place.release()
        place.release()  # idempotent
        assert gate.computing() == 0

    in_a_loop_of_its_own(run)


def test_a_place_given_back_from_another_thread_wakes_the_next_request() -> None:
    """A sync route runs on a worker thread, and steps aside from there (`api.gate.step_aside`)."""

    async def run() -> None:
        gate = Gate(capacity=1, waiting_per_caller=5, max_wait_seconds=30)
        held = await gate.enter("A")
        threading.Timer(0.05, held.release).start()
        (await asyncio.wait_for(gate.enter("B"), timeout=30)).release()

    in_a_loop_of_its_own(run)


# --- a flooded API, over HTTP ---------------------------------------------------------------------------------------

TOKENS = {"alice-token": {"owner": "alice"}, "mallory-token": {"owner": "mallory"},
          "admin-token": {"owner": "ops", "admin": True}}  # fmt: skip
SPEC = {"entrypoint": {"callable": "examples.mlp:train_loop"}, "resources": {"num_workers": 1}}
SWEEP = {"base": SPEC | {"config": {"blob": "x" * 4000}}, "count": 100}  # the flood bench's sweep: ~0.4 MB of specs


@pytest.fixture
def api(db: Engine, tmp_path: Path) -> Iterator[str]:
    with live_api(db, tmp_path, api_tokens=TOKENS, api_concurrency=1, api_waiting_per_caller=64,
                  api_max_wait_seconds=120) as live:  # fmt: skip
        yield live.url


def gauge(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer admin-token"}, timeout=120).text
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_a_quiet_caller_is_served_next_while_another_floods(api: str) -> None:
    """One place (api_concurrency=1), twelve sweeps of mallory's waiting for it: alice's submit, sent after all of
    them, gets the next free place. Mallory's sweeps that end before alice's answer can only be the one computing
    when alice came, and the one that held the place as it was handed on."""
    done: list[str] = []
    lock = threading.Lock()

    def post(who: str, path: str, body: dict[str, object]) -> int:
        r = httpx.post(f"{api}{path}", json=body, headers={"Authorization": f"Bearer {who}-token"}, timeout=300)
        with lock:
            done.append(who)
        return r.status_code

    with ThreadPoolExecutor(13) as pool:
        flood = [pool.submit(post, "mallory", "/v1/sweeps", SWEEP) for _ in range(12)]
        wait_for(lambda: gauge(api, "shunter_api_requests_waiting") >= 10, timeout=120,
                 what="mallory's sweeps waiting for the place")  # fmt: skip
        assert post("alice", "/v1/jobs", SPEC | {"name": "quiet"}) == 201
        # every answer that passed the gate says how long it waited for its place, then how long it worked
        timing = httpx.get(f"{api}/v1/jobs", headers={"Authorization": "Bearer alice-token"}, timeout=300)
        assert re.fullmatch(r"gate;dur=[0-9.]+, app;dur=[0-9.]+", timing.headers["server-timing"])
        with lock:
            before_alice = done.index("alice")
        assert [f.result() for f in flood] == [201] * 12  # waited their turn: nothing of mallory's was refused
    assert before_alice <= 2, done


def test_a_flood_past_its_waiting_line_is_refused_with_429_and_retry_after(db: Engine, tmp_path: Path) -> None:
    with live_api(db, tmp_path, api_tokens=TOKENS, api_concurrency=1, api_waiting_per_caller=2,
                  api_max_wait_seconds=120) as live:  # fmt: skip
        headers = {"Authorization": "Bearer mallory-token"}
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: httpx.post(f"{live.url}/v1/sweeps", json=SWEEP, headers=headers,
                                                         timeout=300), range(8)))  # fmt: skip
        refused = [r for r in answers if r.status_code == 429]
        assert refused and all(r.status_code in (201, 429) for r in answers), [r.status_code for r in answers]
        assert refused[0].json()["code"] == "too_many_requests" and refused[0].headers["retry-after"] == "1"
        assert gauge(live.url, 'shunter_api_requests_refused_total{reason="full"}') == len(refused)
        alice = httpx.get(f"{live.url}/v1/jobs", headers={"Authorization": "Bearer alice-token"}, timeout=60)
        assert alice.status_code == 200


def test_a_follow_stream_gives_its_place_back_while_it_waits(db: Engine, tmp_path: Path) -> None:
    """One place; a follow stream open (it waits on news for up to its timeout): alice's other requests are served
    meanwhile, not kept waiting for the stream to end (they would be refused at the 5 s bound)."""
    with live_api(db, tmp_path, api_tokens=TOKENS, api_concurrency=1, api_max_wait_seconds=5) as live:
        headers = {"Authorization": "Bearer alice-token"}
        with httpx.stream("GET", f"{live.url}/v1/events", params={"follow": "true", "timeout_seconds": 60},
                          headers=headers, timeout=120) as stream:  # fmt: skip
            assert stream.status_code == 200
            for _ in range(3):
                assert httpx.get(f"{live.url}/v1/jobs", headers=headers, timeout=60).status_code == 200


def test_a_tenant_and_its_jobs_are_one_caller_whatever_credentials_they_hold() -> None:
    """The gate keys a request by the owner its credential speaks for: two user tokens of one owner and the attempt
    tokens of that owner's jobs (the owner is signed into them) share one line, so a tenant's jobs cannot flood the
    API beside their owner as callers of their own (bench/flood.py: p99 3.5x quiet when they could). A token that
    does not verify, or one issued without an owner, is a caller of its own."""
    from api.app import credential_owners
    from api.gate import caller_key
    from service.config.settings import Settings
    from service.tenancy import attempt_tokens

    secret = "gate-test-secret-" + "k" * 16
    settings = Settings(progress_secret=secret, api_tokens={"m1": {"owner": "mallory"}, "m2": {"owner": "mallory"},
                                                            "a1": {"owner": "alice"}})  # fmt: skip
    owner_of = credential_owners(settings, lambda: None)

    def key(credential: str) -> str:
        return caller_key({"headers": [(b"authorization", f"Bearer {credential}".encode())]}, owner_of)

    signed = attempt_tokens.issue("jmallory1", 1, secret, owner="mallory")
    assert key("m1") == key("m2") == key(signed) == "o:mallory" != key("a1")
    forged = attempt_tokens.issue("jmallory1", 1, "not-the-key-" + "x" * 20, owner="alice")
    unowned = attempt_tokens.issue("jmallory1", 1, secret)
    assert {key(forged), key(unowned), key("unknown")}.isdisjoint({"o:mallory", "o:alice"})
    assert len({key(forged), key(unowned), key("unknown")}) == 3
