"""Which samples each rank reads, for training and for evaluation.

Training (:class:`ShardedBatchSampler`). Each epoch shuffles the whole dataset with one seed that
every rank shares, cuts the order into *global batches* of ``world_size x batch_size`` samples, and
gives rank r the r-th slice of ``batch_size`` samples of each global batch. So N ranks with batch B
see exactly the batches one process with batch N*B sees, and the average of their gradients is that
process's gradient. **The rule for a dataset whose size does not divide:** the last
``len(dataset) mod (N*B)`` samples of each epoch's order are not used in that epoch (with
shuffling, a different set each epoch). No sample is repeated and every rank takes the same number
of steps, so no rank waits at a barrier for a batch that never comes.

Evaluation (:func:`eval_shard`). Rank r takes a contiguous block of the dataset; the first
``len mod N`` ranks take one sample more. Nothing is padded or dropped, so a sum reduced over ranks
counts every sample exactly once.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized

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


def eval_shard(dataset: Sized, rank: int, world_size: int) -> range:
    """The contiguous block of indices rank ``rank`` evaluates."""
    n = len(dataset)
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))
