"""Datasets that ship with distml's dependencies, so that examples and tests need no download."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset


def digits(split: str = "train", val_fraction: float = 0.2, seed: int = 0) -> TensorDataset:
    """scikit-learn's handwritten digits: 1,797 grey 8x8 images of 0-9, as (N, 1, 8, 8) floats.

    The split is deterministic: one permutation from ``seed``, the last ``val_fraction`` held out.

    >>> train = digits("train"); x, y = train[0]; tuple(x.shape), int(y) < 10
    ((1, 8, 8), True)
    """
    from sklearn.datasets import load_digits

    if split not in ("train", "val", "all"):
        raise ValueError(f"split must be 'train', 'val' or 'all', got {split!r}")
    bunch = load_digits()
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.long)
    if split == "all":
        return TensorDataset(x, y)
    idx = holdout_indices(len(y), split, val_fraction, seed)
    return TensorDataset(x[idx], y[idx])


def holdout_indices(n: int, split: str, val_fraction: float = 0.2, seed: int = 0) -> torch.Tensor:
    """The indices of ``split`` ("train" or "val") among ``n`` samples: one permutation from
    ``seed``, its last ``val_fraction`` held out."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_val = int(n * val_fraction)
    return order[: n - n_val] if split == "train" else order[n - n_val :]
