"""Sharding rule for training batches and resumable loading."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from distml.data import ShardedBatchSampler, ShardedLoader


def batches(sampler: ShardedBatchSampler) -> list[list[int]]:
    return list(iter(sampler))


@pytest.mark.parametrize("n,world,batch", [(103, 4, 5), (100, 2, 10), (50, 3, 7)])
def test_ranks_together_read_the_single_process_global_batches(n, world, batch):
    ranks = [ShardedBatchSampler(n, batch, r, world, seed=3) for r in range(world)]
    single = ShardedBatchSampler(n, batch * world, 0, 1, seed=3)
    for _epoch in range(2):
        per_rank = [batches(s) for s in ranks]
        expected = batches(single)
        assert len(expected) == n // (batch * world)
        for step, global_batch in enumerate(expected):
            assert sum((r[step] for r in per_rank), []) == global_batch
        used = sum(expected, [])
        assert len(used) == len(set(used))  # nothing repeated; n mod (world*batch) left out


def test_shuffle_differs_by_epoch():
    s = ShardedBatchSampler(64, 8, 0, 1, seed=0)
    assert batches(s) != batches(s)


def test_too_small_dataset_is_refused():
    with pytest.raises(ValueError, match="fewer than one global batch"):
        ShardedBatchSampler(10, 4, 0, 3)


def test_loader_resumes_mid_epoch():
    data = TensorDataset(torch.arange(40))
    whole = ShardedLoader(data, 4, 1, 2, seed=1)
    expected = [b[0].tolist() for _ in range(2) for b in whole]
    first = ShardedLoader(data, 4, 1, 2, seed=1)
    seen = []
    for i, (b,) in enumerate(first):
        seen.append(b.tolist())
        if i == 2:
            break
    state = first.state_dict()
    assert state == {"epoch": 0, "position": 3}
    again = ShardedLoader(data, 4, 1, 2, seed=1)
    again.load_state_dict(state)
    seen += [b.tolist() for (b,) in again]
    seen += [b.tolist() for (b,) in again]
    assert seen == expected
    assert again.state_dict() == {"epoch": 2, "position": 0}


def test_claimed_batches_are_the_fixed_shards_global_batches_in_the_order_claimed():
    """Two ranks draw from one counter, rank 0 three times as often: each epoch they use the
    same samples as the fixed shards, once each, and a loader resumes within an epoch."""
    n, world, batch = 103, 2, 5
    taken: dict[int, int] = {}

    def claim(epoch: int, position: int, total: int) -> int | None:
        index = taken.get(epoch, 0)
        taken[epoch] = index + 1
        return index if index < total else None

    data = TensorDataset(torch.arange(n))
    loaders = [ShardedLoader(data, batch, r, world, seed=3, claim=claim) for r in range(world)]
    fixed = [ShardedBatchSampler(n, batch, r, world, seed=3) for r in range(world)]
    for _epoch in range(2):
        expected = sorted(sum((sum(batches(s), []) for s in fixed), []))
        iters, seen = [iter(loader) for loader in loaders], {0: [], 1: []}
        for rank in [0, 0, 0, 1] * 10:
            (x,) = next(iters[rank], (None,))
            if x is not None:
                seen[rank] += x.tolist()
        assert len(seen[0]) == 3 * len(seen[1])  # the fast rank took 3 batches for each of 1
        assert sorted(seen[0] + seen[1]) == expected  # every sample once, as the fixed shards
        for it in iters:
            assert next(it, None) is None  # the epoch is used up for both
    assert [loader.epoch for loader in loaders] == [2, 2]
    # Mid-epoch, the loader's state is its epoch; a resumed loader claims on from the counter.
    it = iter(loaders[0])
    next(it)
    assert loaders[0].state_dict() == {"epoch": 2, "position": 1}
    resumed = ShardedLoader(data, batch, 0, world, seed=3, claim=claim)
    resumed.load_state_dict(loaders[0].state_dict())
    (x,) = next(iter(resumed))
    order = torch.randperm(n, generator=torch.Generator().manual_seed(3 + 2))
    assert x.tolist() == order[batch : 2 * batch].tolist()  # batch 1 of epoch 2
