"""What a preprocessing worker may read and write, learnt from what it knows itself: the output
folder of its own configuration (``--out``) and the record the job left there (``_job.json``:
its source, its number of shards, its fingerprint). The coordinator's answers are checked
against it, so that whoever answers in the coordinator's place (anyone on the path of a plain
HTTP connection) cannot make a worker read a file outside the job's input or write one outside
the job's output folder.

>>> scope = JobScope.open("out/", fingerprint)  # doctest: +SKIP
>>> scope.write(table, "3.7")                   # out/.tmp/attempt-3.7.parquet  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import TypeAdapter, ValidationError

from distml.config import describe_errors
from distml.data.preprocess.output import JOB, TMP, OutputDir
from distml.data.preprocess.protocol import (
    CsvShard,
    FilesShard,
    ParquetShard,
    ShardModel,
    SqlShard,
)
from distml.data.preprocess.sources import (
    CsvSource,
    FilesSource,
    ParquetSource,
    Shard,
    Source,
    SqlSource,
    files_root,
    inside,
    without_password,
)

# SQLAlchemy (an optional extra) is imported only for SQL sources.

ATTEMPT = re.compile(r"\d{1,18}\.\d{1,18}")
_SOURCE = TypeAdapter(Source)
_SHARD = TypeAdapter(ShardModel)


class RefusedAnswer(RuntimeError):
    """An answer of the coordinator that this worker will not act on: malformed, or naming a
    file outside the job's input or output."""


class JobScope:
    """The job a worker was given: its input (the source in ``_job.json``) and its output folder."""

    def __init__(self, out: Path, job: dict[str, Any], source: Source):
        self.out = out
        self.job = job
        self.source = source

    @classmethod
    def open(cls, out: Path | str, fingerprint: str) -> JobScope:
        """The scope of the job in ``out``, which must be the job ``fingerprint`` names (the one
        the coordinator runs): ``ValueError`` otherwise, a mistake in the worker's settings."""
        folder = Path(out).resolve()
        try:
            job = json.loads((folder / JOB).read_text())
            source = _SOURCE.validate_python(job["source"])
            int(job["shards"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"{out} holds no preprocessing job ({JOB}: {exc}); a worker needs the "
                "coordinator's output folder, at the same path (a shared file system)"
            ) from None
        if job.get("fingerprint") != fingerprint:
            raise ValueError(
                f"{out} holds the output of another job than the coordinator's; give the worker "
                "the --out the coordinator was given"
            )
        return cls(folder, job, source)

    def shard(self, shard: Any) -> Shard:
        """``shard`` as :func:`~distml.data.preprocess.sources.read_shard` takes it, once it is
        known to be a shard of this job's input."""
        try:
            model = _SHARD.validate_python(shard)
        except ValidationError as exc:
            raise RefusedAnswer(f"a malformed shard: {describe_errors(exc, 1)}") from None
        if model.id >= int(self.job["shards"]):
            raise RefusedAnswer(f"shard {model.id}: the job has {self.job['shards']} shards")
        if model.kind != self.source.kind:
            raise RefusedAnswer(f"a {model.kind} shard in a job over {self.source.kind} input")
        _CHECKS[model.kind](model, self.source)
        return model.model_dump()

    def output_path(self, attempt: str) -> Path:
        """Where attempt ``attempt`` writes: a name of the worker's making in the output
        folder's ``.tmp/``, which must be a folder of its own, not a link elsewhere."""
        if not ATTEMPT.fullmatch(attempt):
            raise RefusedAnswer(f"attempt {attempt!r} is not an attempt ID")
        tmp = self.out / TMP
        if tmp.is_symlink() or not tmp.is_dir():
            raise RefusedAnswer(f"{tmp} is not a folder of the job's output")
        return OutputDir(self.out, self.job).tmp_path(attempt)

    def write(self, table: pa.Table, attempt: str) -> Path:
        """Write ``table`` as attempt ``attempt``'s Parquet file; a link planted at its name is
        refused (``O_NOFOLLOW``), not followed."""
        path = self.output_path(attempt)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        with os.fdopen(os.open(path, flags, 0o644), "wb") as f:
            pq.write_table(table, f)
        return path


def _check_files(shard: FilesShard, source: FilesSource) -> None:
    root = files_root(source.pattern)
    for path in shard.paths:
        if not inside(Path(path), root):
            raise RefusedAnswer(f"{path} is outside the job's input {root}")


def _check_csv(shard: CsvShard, source: CsvSource) -> None:
    if shard.path != str(Path(source.path)):
        raise RefusedAnswer(f"{shard.path} is not the job's input {source.path}")
    if not shard.header <= shard.start <= shard.end:
        raise RefusedAnswer(f"bytes {shard.start}..{shard.end} after a header of {shard.header}")


def _check_parquet(shard: ParquetShard, source: ParquetSource) -> None:
    if shard.path not in source.paths:
        raise RefusedAnswer(f"{shard.path} is not one of the job's input files")


def _check_sql(shard: SqlShard, source: SqlSource) -> None:
    """The shard's database (driver, host, database, user; a password aside), table and key must
    be the job's."""
    from sqlalchemy.exc import ArgumentError

    try:
        url = without_password(shard.url)
    except (ArgumentError, ValueError):
        raise RefusedAnswer("the shard's database URL is not a URL") from None
    if (url, shard.table, shard.key) != (source.safe_url(), source.table, source.key):
        raise RefusedAnswer(f"table {shard.table!r} at {url} is not the job's input")


_CHECKS = {"files": _check_files, "csv": _check_csv, "parquet": _check_parquet, "sql": _check_sql}
