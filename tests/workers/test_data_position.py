"""Where a resumed run picks its epoch up (`workers.checkpoint.skip_for`), against the DistributedSampler it reads
through: at any new world size, no sample of the epoch is skipped and fewer than one batch per rank is read twice.
(tests/workers/test_strategies.py proves the same on real Ray Train runs resumed at 3 and at 1 workers.)"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler

from workers.checkpoint import skip_for


@pytest.mark.parametrize(
    ("state", "batch_size", "world_size", "expected"),
    [
        pytest.param({"batch_in_epoch": 5, "samples_in_epoch": 40, "world_size": 2}, 4, 2, 5, id="same-size"),
        pytest.param({"batch_in_epoch": 5, "samples_in_epoch": 40, "world_size": 2}, 4, 1, 10, id="narrower"),
        pytest.param({"batch_in_epoch": 5, "samples_in_epoch": 40, "world_size": 2}, 4, 4, 2, id="wider-even"),
        # 40 samples read, 12 per step at 3 workers: 3 whole steps (36), the last 4 read again
        pytest.param({"batch_in_epoch": 5, "samples_in_epoch": 40, "world_size": 2}, 4, 3, 3, id="wider-rounds-down"),
        pytest.param({"batch_in_epoch": 5, "world_size": 2}, 4, 3, 5, id="older-checkpoint-has-no-samples"),
        pytest.param(
            {"batch_in_epoch": 5, "samples_in_epoch": None, "world_size": 2}, None, 3, 5, id="loader-without-batch-size"
        ),  # fmt: skip
        pytest.param({"batch_in_epoch": 0, "samples_in_epoch": 0, "world_size": 2}, 4, 3, 0, id="epoch-start"),
    ],
)
def test_skip_for(state: dict, batch_size: int | None, world_size: int, expected: int) -> None:
    assert skip_for(state, batch_size, world_size) == expected


def rank_reads(n: int, world: int, rank: int, epoch: int) -> list[int]:
    sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    return list(sampler)


@given(
    n=st.integers(8, 200), batch=st.integers(1, 8), before=st.integers(1, 6), after=st.integers(1, 6),
    read=st.integers(0, 40), epoch=st.integers(0, 3),
)  # fmt: skip
def test_no_sample_skipped_and_under_a_batch_per_rank_read_twice(
    n: int, batch: int, before: int, after: int, read: int, epoch: int
) -> None:
    per_rank = len(rank_reads(n, before, 0, epoch)) // batch  # whole batches each rank has in the epoch
    read = min(read, per_rank)
    seen: list[int] = []
    for rank in range(before):
        seen += rank_reads(n, before, rank, epoch)[: read * batch]
    state = {"batch_in_epoch": read, "samples_in_epoch": read * batch * before, "world_size": before}
    skip = skip_for(state, batch, after)
    again: list[int] = []
    for rank in range(after):
        again += rank_reads(n, after, rank, epoch)[skip * batch :]
    assert set(seen) | set(again) == set(range(n)), "a sample of the epoch was skipped"
    # Read twice: fewer than one batch per rank, plus what the new size's padding repeats (under one per rank).
    assert len(set(seen) & set(again)) < after * batch + after, (skip, sorted(set(seen) & set(again)))
