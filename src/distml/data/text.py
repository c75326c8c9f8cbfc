"""A real text corpus that needs no download: the Python standard library's own source files.

Every Python installation carries them. Files are read in sorted order of their path relative to
the library root, as bytes (byte-level tokens, a vocabulary of 256), and each goes wholly to the
training or the validation split by a hash of that path (CRC-32 mod 10 == 0: validation), so the
split is the same on every machine with the same Python and no file is in both.
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from functools import lru_cache
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

VOCAB_SIZE = 256


@lru_cache(maxsize=4)
def _corpus(split: str, max_bytes: int) -> bytes:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, subfolders, names in os.walk(root):
        # Installed packages and the test suite are not the standard library's own source.
        subfolders[:] = [d for d in subfolders if d not in ("site-packages", "test", "tests")]
        files += [Path(folder, n).relative_to(root).as_posix() for n in names if n.endswith(".py")]
    out = bytearray()
    for rel in sorted(files):
        path = root / rel
        held_out = zlib.crc32(rel.encode()) % 10 == 0
        if held_out != (split == "val"):
            continue
        try:
            out += path.read_bytes()
        except OSError:
            continue
        if len(out) >= max_bytes:
            break
    return bytes(out[:max_bytes])


def stdlib_text(
    split: str = "train", seq_len: int = 64, max_bytes: int = 2_000_000
) -> TensorDataset:
    """Byte-level language-modelling samples ``(x, y)`` of ``seq_len`` tokens, ``y`` = ``x``
    shifted by one, from consecutive non-overlapping windows of the corpus.

    >>> ds = stdlib_text("val", seq_len=32, max_bytes=10_000); x, y = ds[0]
    >>> x.shape, bool((x[1:] == y[:-1]).all())
    (torch.Size([32]), True)
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    data = torch.frombuffer(bytearray(_corpus(split, max_bytes)), dtype=torch.uint8).long()
    n = (len(data) - 1) // seq_len
    if n < 1:
        raise ValueError(f"max_bytes {max_bytes} holds no sample of {seq_len + 1} bytes")
    x = data[: n * seq_len].view(n, seq_len)
    y = data[1 : n * seq_len + 1].view(n, seq_len)
    return TensorDataset(x, y)
