"""A data loader over this rank's shard that can stop and resume mid-epoch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from distml.data.sampler import Claim, ClaimedBatchSampler, ShardedBatchSampler


class ShardedLoader:
    """Iterates this rank's batches; ``state_dict()`` records the epoch and position.

    With ``claim``, the batches are not a fixed shard but claimed one at a time
    (:class:`~distml.data.sampler.ClaimedBatchSampler`).

    Each ``iter()`` continues where the last one stopped: a finished epoch moves to the next, an
    interrupted one (or one restored with ``load_state_dict``) continues at its next batch.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        rank: int,
        world_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        claim: Claim | None = None,
        **loader_kwargs: Any,
    ):
        if claim is None:
            self.sampler = ShardedBatchSampler(
                len(dataset), batch_size, rank, world_size, shuffle=shuffle, seed=seed
            )
        else:
            self.sampler = ClaimedBatchSampler(
                len(dataset), batch_size, world_size, claim, shuffle=shuffle, seed=seed
            )
        # A generator of its own: DataLoader draws a seed each time an iterator is made, and from
        # the global RNG that would shift every later random number (dropout...) after a resume.
        loader_kwargs.setdefault("generator", torch.Generator().manual_seed(seed))
        self._loader = DataLoader(
            dataset, batch_sampler=self.sampler, num_workers=num_workers, **loader_kwargs
        )
        self._state = self.sampler.state_dict()

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        # Counted here, not in the sampler: loader workers fetch indices ahead of what was used.
        epoch, start = self.sampler.epoch, self.sampler.position
        for consumed, batch in enumerate(self._loader, start=start + 1):
            self._state = self._normalise(epoch, consumed)
            yield batch
        self._state = {"epoch": epoch + 1, "position": 0}

    def _normalise(self, epoch: int, position: int) -> dict[str, int]:
        if self.sampler.epoch_done(position):
            return {"epoch": epoch + 1, "position": 0}
        return {"epoch": epoch, "position": position}

    @property
    def epoch(self) -> int:
        return self._state["epoch"]

    def state_dict(self) -> dict[str, int]:
        """Where the next batch comes from: ``{"epoch": e, "position": batches used of e}``."""
        return dict(self._state)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._state = self._normalise(int(state["epoch"]), int(state["position"]))
        self.sampler.load_state_dict(self._state)
