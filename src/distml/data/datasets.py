"""Datasets that ship with distml's dependencies, so that examples and tests need no download."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save_file
from torch.utils.data import TensorDataset

# scikit-learn is imported only to read the digits the first time; the cache serves after.

CACHE_ENV = "DISTML_CACHE"


def cache_dir() -> Path:
    """Where distml keeps what it derives once per machine: ``$DISTML_CACHE``, else
    ``$XDG_CACHE_HOME/distml``, else ``~/.cache/distml``."""
    if folder := os.environ.get(CACHE_ENV):
        return Path(folder)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "distml"


def digits_arrays() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's digits as they ship: images (1797, 8, 8) of intensities 0-16 (uint8) and
    labels (int64). Importing scikit-learn costs about 1.5 s of CPU, and every worker process
    of a digits job would pay it: the arrays are read from a safetensors copy in
    :func:`cache_dir` instead, written by the first process that needed them."""
    path = cache_dir() / "digits-v1.safetensors"
    try:
        arrays = load(path.read_bytes())  # in memory: a mapped file could change under it
        return arrays["images"], arrays["labels"]
    except (OSError, SafetensorError, KeyError):
        pass  # not cached yet (or a damaged copy): read it from scikit-learn, then cache it
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = torch.tensor(bunch.images, dtype=torch.uint8)
    labels = torch.tensor(bunch.target, dtype=torch.int64)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written aside, then renamed: processes starting together never read half a file.
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as tmp:
            save_file({"images": images, "labels": labels}, tmp.name)
        os.replace(tmp.name, path)
    except OSError:
        pass  # a read-only home: no cache, the same arrays
    return images, labels


def digits(split: str = "train", val_fraction: float = 0.2, seed: int = 0) -> TensorDataset:
    """scikit-learn's handwritten digits: 1,797 grey 8x8 images of 0-9, as (N, 1, 8, 8) floats.

    The split is deterministic: one permutation from ``seed``, the last ``val_fraction`` held out.

    >>> train = digits("train"); x, y = train[0]; tuple(x.shape), int(y) < 10
    ((1, 8, 8), True)
    """
    if split not in ("train", "val", "all"):
        raise ValueError(f"split must be 'train', 'val' or 'all', got {split!r}")
    images, y = digits_arrays()
    x = images.float().unsqueeze(1) / 16.0
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
