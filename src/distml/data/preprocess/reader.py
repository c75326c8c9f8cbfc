"""Reading a preprocessing job's output back: the whole table, or this rank's stream of batches.

Rank r of W streams a contiguous block of ``rows // W`` rows of the parts in the job's order (its
``_manifest.json``), reading only the parts that overlap its block, batch by batch. Every rank
gets the same number of rows, so data-parallel ranks take the same number of steps; the last
``rows mod W`` rows are left out. With ``shuffle``, each epoch permutes the parts (with a seed
every rank shares) before cutting the blocks; rows keep their order within a part.

>>> data = PreprocessedShards("out/", columns=["x", "y"], batch_size=64)  # doctest: +SKIP
>>> for batch in data: batch["x"].shape                                  # doctest: +SKIP
torch.Size([64, 16])
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset

from distml.data.preprocess.output import MANIFEST


def read_manifest(path: Path | str) -> dict:
    manifest = Path(path) / MANIFEST
    if not manifest.is_file():
        raise FileNotFoundError(f"{path} holds no finished preprocessing job (no {MANIFEST})")
    return json.loads(manifest.read_text())


def read_table(path: Path | str, columns: Sequence[str] | None = None) -> pa.Table:
    """Every part, in input order, as one table."""
    parts = read_manifest(path)["parts"]
    return pa.concat_tables(pq.read_table(Path(path) / p["file"], columns=columns) for p in parts)


def column_tensor(column: pa.ChunkedArray | pa.Array) -> torch.Tensor:
    """A numeric column as a tensor; a fixed-size list column as a 2-D one."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if pa.types.is_fixed_size_list(column.type):
        width = column.type.list_size
        return torch.from_numpy(
            column.flatten().to_numpy(zero_copy_only=False).reshape(-1, width).copy()
        )
    if not (
        pa.types.is_integer(column.type)
        or pa.types.is_floating(column.type)
        or pa.types.is_boolean(column.type)
    ):
        raise TypeError(f"a {column.type} column is not a tensor; leave it out with columns=")
    return torch.from_numpy(np.array(column.to_numpy(zero_copy_only=False)))


class PreprocessedShards(IterableDataset):
    """This rank's batches (dicts of tensors) of a preprocessing job's output."""

    def __init__(
        self,
        path: Path | str,
        columns: Sequence[str],
        batch_size: int,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
    ):
        if rank is None or world_size is None:
            rank, world_size = _dist_rank()
        self.path = Path(path)
        self.parts = read_manifest(path)["parts"]
        self.columns = list(columns)
        self.batch_size = batch_size
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.seed = shuffle, seed
        self.epoch = 0
        self.rows_per_rank = sum(p["rows"] for p in self.parts) // world_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return -(-self.rows_per_rank // self.batch_size)

    def _order(self) -> list[dict]:
        if not self.shuffle:
            return self.parts
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return [self.parts[i] for i in torch.randperm(len(self.parts), generator=g).tolist()]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        begin = self.rank * self.rows_per_rank
        end = begin + self.rows_per_rank
        pending: list[pa.Table] = []
        buffered = 0
        offset = 0  # global row index of the current part's first row
        for part in self._order():
            lo, hi = max(begin, offset), min(end, offset + part["rows"])
            offset += part["rows"]
            if lo >= hi:
                continue
            table = pq.read_table(self.path / part["file"], columns=self.columns)
            pending.append(table.slice(lo - (offset - part["rows"]), hi - lo))
            buffered += hi - lo
            while buffered >= self.batch_size:
                merged = pa.concat_tables(pending)
                yield self._batch(merged.slice(0, self.batch_size))
                pending, buffered = [merged.slice(self.batch_size)], buffered - self.batch_size
        if buffered:
            yield self._batch(pa.concat_tables(pending))

    def _batch(self, table: pa.Table) -> dict[str, torch.Tensor]:
        return {name: column_tensor(table.column(name)) for name in self.columns}


def _dist_rank() -> tuple[int, int]:

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
