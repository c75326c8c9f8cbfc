"""A preprocessing job's output folder: one Parquet file per input shard, and the record of which
shards are done, so that a restarted job skips them.

    out/
      _job.json         what produced this folder (source, transform, shard count, fingerprint)
      _done.jsonl       one line per committed shard, appended and fsynced as each one lands
      part-00000.parquet ...
      _manifest.json    written at the end: every part in input order with its rows
      .tmp/             workers' files before they are committed

Workers write into ``.tmp/``; only :meth:`OutputDir.commit` moves a file to its ``part-`` name,
after reading back its row count and checking its schema against the parts already there.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

JOB, DONE, MANIFEST, TMP = "_job.json", "_done.jsonl", "_manifest.json", ".tmp"


class OutputError(RuntimeError):
    """The folder holds another job's output, or a worker's file is not a valid part."""


def part_name(shard: int) -> str:
    return f"part-{shard:05d}.parquet"


class OutputDir:
    def __init__(self, path: Path | str, job: dict[str, Any]):
        self.path = Path(path)
        self.job = job
        self.schema = None

    def open(self) -> dict[int, float]:
        """Create the folder, or reopen one this same job started: the shards already done
        (shard -> seconds). A folder of a different job is refused, never overwritten."""
        job_file = self.path / JOB
        if job_file.is_file():
            previous = json.loads(job_file.read_text())
            if previous.get("fingerprint") != self.job["fingerprint"]:
                raise OutputError(
                    f"{self.path} holds the output of another job ({previous.get('transform')} "
                    f"over {previous.get('source')}); choose another output folder or remove it"
                )
        elif self.path.exists() and any(self.path.iterdir()):
            raise OutputError(f"{self.path} is not empty and holds no distml preprocessing job")
        (self.path / TMP).mkdir(parents=True, exist_ok=True)
        _write_atomic(job_file, json.dumps(self.job, indent=2))
        done: dict[int, float] = {}
        log = self.path / DONE
        if log.is_file():
            for line in log.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a crash: that shard is redone
                part = self.path / part_name(record["shard"])
                if part.is_file() and part.stat().st_size == record["bytes"]:
                    done[record["shard"]] = record["seconds"]
        if done:
            self.schema = pq.read_schema(self.path / part_name(min(done)))
        return done

    def tmp_path(self, attempt: str) -> Path:
        return self.path / TMP / f"attempt-{attempt}.parquet"

    def check(self, shard: int, attempt: str, worker: str) -> tuple[pq.FileMetaData, pa.Schema]:
        """The metadata and schema of an attempt's file, once it is known to be a Parquet file of
        its own (not a link) with the schema of the parts already there; ``OutputError``
        otherwise. Nothing changes either way: a refused file is left for its worker to replace
        or report as failed."""
        tmp = self.tmp_path(attempt)
        try:
            if not stat.S_ISREG(os.lstat(tmp).st_mode):
                raise OutputError("not a regular file")
            meta = pq.read_metadata(tmp)
            schema = pq.read_schema(tmp)
        except (OSError, ValueError, pa.ArrowException, OutputError) as exc:
            raise OutputError(
                f"shard {shard}: {worker} left no readable Parquet file ({exc})"
            ) from None
        if self.schema is not None and not schema.equals(self.schema):
            raise OutputError(
                f"shard {shard}'s output has columns {schema.names} ({_types(schema)}), "
                f"the earlier shards' {self.schema.names} ({_types(self.schema)}): "
                "the transform must return one schema"
            )
        return meta, schema

    def commit(
        self,
        shard: int,
        attempt: str,
        seconds: float,
        worker: str,
        checked: tuple[pq.FileMetaData, pa.Schema],
    ) -> dict[str, Any]:
        """Move an attempt's file, which :meth:`check` passed (``checked`` is its answer), to
        its part name and record it; returns the record."""
        meta, schema = checked
        tmp = self.tmp_path(attempt)
        if self.schema is None:
            self.schema = schema
        part = self.path / part_name(shard)
        os.replace(tmp, part)
        record = {
            "shard": shard,
            "rows": meta.num_rows,
            "bytes": part.stat().st_size,
            "seconds": round(seconds, 6),
            "worker": worker,
        }
        with (self.path / DONE).open("a") as log:
            log.write(json.dumps(record) + "\n")
            log.flush()
            os.fsync(log.fileno())
        return record

    def discard(self, attempt: str) -> None:
        self.tmp_path(attempt).unlink(missing_ok=True)

    def finalize(self, shards: int, stats: dict[str, Any]) -> dict[str, Any]:
        parts = [
            {"file": part_name(i), "rows": pq.read_metadata(self.path / part_name(i)).num_rows}
            for i in range(shards)
        ]
        manifest = {
            **{k: self.job[k] for k in ("source", "transform", "fingerprint")},
            "rows": sum(p["rows"] for p in parts),
            "columns": self.schema.names if self.schema is not None else [],
            "parts": parts,
            "stats": stats,
        }
        _write_atomic(self.path / MANIFEST, json.dumps(manifest, indent=2))
        shutil.rmtree(self.path / TMP, ignore_errors=True)
        return manifest


def _types(schema) -> str:
    return ", ".join(f"{f.name}: {f.type}" for f in schema)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
