"""Distributed preprocessing: a coordinator cuts the input into shards and hands them to workers,
which transform each into a Parquet file; the training data loader streams the result by rank.

See :func:`preprocess` (the job), :mod:`.sources` (files, CSV, Parquet, SQL), :mod:`.queue`
(leases, retries, speculation) and :class:`PreprocessedShards` (reading it back).
"""

from distml.data.preprocess.job import PreprocessError, PreprocessResult, preprocess
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

__all__ = [
    "CsvSource",
    "FilesSource",
    "OutputError",
    "ParquetSource",
    "PreprocessError",
    "PreprocessResult",
    "PreprocessedShards",
    "SourceError",
    "SqlSource",
    "plan",
    "preprocess",
    "read_manifest",
    "read_shard",
    "read_table",
]
