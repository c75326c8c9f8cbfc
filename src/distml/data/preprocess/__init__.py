"""Distributed preprocessing: a coordinator cuts the input into shards and hands them to workers,
which transform each into a Parquet file; the training data loader streams the result by rank.

The job that starts the coordinator and its workers is :func:`distml.jobs.preprocess.preprocess`;
here are its parts: :mod:`.sources` (files, CSV, Parquet, SQL), :mod:`.queue` (leases, retries,
speculation), the coordinator and the worker, and :class:`PreprocessedShards` (reading it back).

Names are imported on first use (PEP 562): a worker process, which imports :mod:`.worker`,
needs neither the coordinator's web server nor the job's supervisor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distml._lazy import lazy_getattr

if TYPE_CHECKING:
    from distml.data.preprocess.output import OutputError
    from distml.data.preprocess.reader import PreprocessedShards, read_manifest, read_table
    from distml.data.preprocess.sources import (
        CsvSource,
        FilesSource,
        ParquetSource,
        SourceError,
        SqlSource,
        plan,
        read_shard,
    )

_WHERE = {
    "OutputError": "output",
    "PreprocessedShards": "reader",
    "read_manifest": "reader",
    "read_table": "reader",
    "CsvSource": "sources",
    "FilesSource": "sources",
    "ParquetSource": "sources",
    "SourceError": "sources",
    "SqlSource": "sources",
    "plan": "sources",
    "read_shard": "sources",
}
__getattr__ = lazy_getattr(
    "distml.data.preprocess",
    {name: f"distml.data.preprocess.{m}:{name}" for name, m in _WHERE.items()},
)

__all__ = [
    "CsvSource",
    "FilesSource",
    "OutputError",
    "ParquetSource",
    "PreprocessedShards",
    "SourceError",
    "SqlSource",
    "plan",
    "read_manifest",
    "read_shard",
    "read_table",
]
