"""Which samples each rank reads, for training and for evaluation.

Training (:class:`ShardedBatchSampler`). Each epoch shuffles the whole dataset with one seed that
every rank shares, cuts the order into *global batches* of ``world_size x batch_size`` samples, and
gives rank r the r-th slice of ``batch_size`` samples of each global batch. So N ranks with batch B
see exactly the batches one process with batch N*B sees, and the average of their gradients is that
process's gradient. **The rule for a dataset whose size does not divide:** the last
``len(dataset) mod (N*B)`` samples of each epoch's order are not used in that epoch (with
shuffling, a different set each epoch). No sample is repeated and every rank takes the same number
of steps, so no rank waits at a barrier for a batch that never comes.

Training under an asynchronous parameter server (:class:`ClaimedBatchSampler`). The same
epoch order and the same global batches, but no rank owns a slice: each batch of ``batch_size``
samples goes to whichever rank asks for it next (a counter on the servers hands the batch indices
out). A fast rank takes more batches than a straggler instead of idling once its shard is done,
and every sample is still used once an epoch. The epoch has as many batches as the fixed shards
would give all ranks together, so the rule for sizes that do not divide is the same.

Evaluation (:func:`eval_shard`). Rank r takes a contiguous block of the dataset; the first
``len mod N`` ranks take one sample more. Nothing is padded or dropped, so a sum reduced over ranks
counts every sample exactly once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sized

import torch


class ShardedBatchSampler:
    """Yields this rank's batches of indices; resumable in the middle of an epoch."""

    def __init__(
        self,
        dataset_len: int,
        batch_size: int,
        rank: int,
        world_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if dataset_len < batch_size * world_size:
            raise ValueError(
                f"the dataset has {dataset_len} samples, fewer than one global batch "
                f"({world_size} ranks x batch {batch_size} = {batch_size * world_size})"
            )
        self.dataset_len = dataset_len
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.position = 0  # batches of the current epoch already handed out

    def __len__(self) -> int:
        return self.dataset_len // (self.batch_size * self.world_size)

    def _order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.dataset_len)
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_len, generator=g)

    def epoch_done(self, position: int) -> bool:
        """Whether ``position`` batches are the whole epoch."""
        return position >= len(self)

    def __iter__(self) -> Iterator[list[int]]:
        order = self._order()
        global_batch = self.batch_size * self.world_size
        while self.position < len(self):
            start = self.position * global_batch + self.rank * self.batch_size
            self.position += 1
            yield order[start : start + self.batch_size].tolist()
        self.epoch += 1
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])


Claim = Callable[[int, int, int], int | None]
"""``claim(epoch, position, batches)``: the index of the next unclaimed batch of that epoch (of
``batches``), or None once all are taken; ``position`` counts this rank's claims of the epoch so
far (asked again, the same position gets the same answer)."""


class ClaimedBatchSampler(ShardedBatchSampler):
    """Yields the batches this rank claims, in the order it claims them, until the epoch runs out.

    ``len()`` is a rank's share were all ranks equally fast; a fast rank trains on more. A
    ``DataLoader`` with ``num_workers > 0`` fetches ``prefetch_factor x num_workers`` batches
    ahead, and so claims that many ahead of its training.
    """

    def __init__(
        self,
        dataset_len: int,
        batch_size: int,
        world_size: int,
        claim: Claim,
        *,
        shuffle: bool = True,
        seed: int = 0,
    ):
        super().__init__(dataset_len, batch_size, 0, world_size, shuffle=shuffle, seed=seed)
        self.claim = claim
        self.batches = super().__len__() * world_size  # of the epoch, over every rank

    def epoch_done(self, position: int) -> bool:
        return False  # known only when a claim comes back empty

    def __iter__(self) -> Iterator[list[int]]:
        order = self._order()
        while (index := self.claim(self.epoch, self.position, self.batches)) is not None:
            self.position += 1
            start = index * self.batch_size
            yield order[start : start + self.batch_size].tolist()
        self.epoch += 1
        self.position = 0


def eval_shard(dataset: Sized, rank: int, world_size: int) -> range:
    """The contiguous block of indices rank ``rank`` evaluates."""
    n = len(dataset)
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))
