"""Preprocessing jobs with real worker processes: the output equals the transform applied in one
process, whatever the input kind and whatever happens to the workers."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from distml.data.preprocess import (
    CsvSource,
    FilesSource,
    OutputError,
    ParquetSource,
    PreprocessedShards,
    SourceError,
    SqlSource,
    plan,
    read_manifest,
    read_table,
)
from distml.data.preprocess.worker import as_table
from distml.jobs.preprocess import PreprocessError, preprocess

HERE = Path(__file__).resolve().parent
FEATURES = f"{HERE / 'transforms.py'}:features"
FAULTY = f"{HERE / 'transforms.py'}:faulty"
ROWS = 3000


def _rows(path: Path) -> Path:
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=ROWS), rng.normal(size=ROWS)
    table = pa.table({"id": np.arange(ROWS), "a": a, "b": b, "label": np.arange(ROWS) % 3})
    pacsv.write_csv(table, path)
    return path


@pytest.fixture(scope="module")
def csv(tmp_path_factory) -> Path:
    return _rows(tmp_path_factory.mktemp("input") / "rows.csv")


@pytest.fixture(scope="module")
def oracle(csv) -> pa.Table:
    """The transform over the whole input, in this process."""
    from transforms import features  # noqa: PLC0415 (the file the workers run)

    return as_table(features(pacsv.read_csv(csv)))


@pytest.fixture(autouse=True)
def _transforms_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))


def small(csv: Path) -> CsvSource:
    return CsvSource(path=str(csv), blocksize=8 * 1024)  # about 13 shards of 230 rows


@pytest.mark.distributed
def test_csv_job_equals_one_process_and_streams_by_rank(csv, oracle, tmp_path, monkeypatch):
    monkeypatch.setenv("PP_DELAY_S", "0.3")  # long enough that both workers take shards
    result = preprocess(small(csv), FAULTY, tmp_path / "out", workers=2)
    manifest = read_manifest(tmp_path / "out")
    assert len(manifest["parts"]) > 8 and manifest["rows"] == ROWS
    assert read_table(tmp_path / "out").equals(oracle)
    assert result.stats["attempts"] == len(manifest["parts"]) and result.skipped == 0
    workers = {json.loads(line)["worker"] for line in (tmp_path / "out/_done.jsonl").open()}
    # Each is named by its slot and its process ID.
    assert {w.rsplit("-", 1)[0] for w in workers} == {"local-0", "local-1"}

    world, batch = 3, 64
    ranks = [
        list(PreprocessedShards(tmp_path / "out", ["id", "x"], batch, rank=r, world_size=world))
        for r in range(world)
    ]
    per_rank = ROWS // world
    for r, batches in enumerate(ranks):
        ids = np.concatenate([b["id"].numpy() for b in batches])
        np.testing.assert_array_equal(ids, np.arange(r * per_rank, (r + 1) * per_rank))
        assert len(batches) == -(-per_rank // batch)
        np.testing.assert_array_equal(
            np.concatenate([b["x"].numpy() for b in batches]),
            oracle["x"].combine_chunks().flatten().to_numpy().reshape(-1, 2)[ids],
        )
    again = preprocess(small(csv), FAULTY, tmp_path / "out", workers=2)
    assert again.skipped == len(manifest["parts"]) and again.stats["attempts"] == 0


@pytest.mark.distributed
def test_a_worker_killed_mid_job_loses_nothing(csv, oracle, tmp_path, monkeypatch):
    """The fifth shard SIGKILLs its worker once; its lease runs out, another worker redoes it,
    the dead one is restarted: the output is the uninterrupted run's (speculation off, so that
    the lease is what brings the shard back)."""
    monkeypatch.setenv("PP_MARKERS", str(tmp_path))
    first_ids = read_table_ids(csv)
    monkeypatch.setenv("PP_KILL_AT", str(first_ids[4]))
    monkeypatch.setenv("PP_DELAY_S", "0.1")
    result = preprocess(
        small(csv), FAULTY, tmp_path / "out", workers=2, lease_s=2, speculate_after=0
    )
    assert (tmp_path / f"PP_KILL_AT-{first_ids[4]}").exists()  # the kill did happen
    assert result.stats["lost_leases"] == 1 and result.worker_restarts == 1
    assert read_table(tmp_path / "out").equals(oracle)
    reference = preprocess(small(csv), FEATURES, tmp_path / "reference", workers=1)
    for part in reference.manifest["parts"]:
        a = pq.read_table(tmp_path / "out" / part["file"])
        assert a.equals(pq.read_table(tmp_path / "reference" / part["file"]))


def read_table_ids(csv: Path) -> list[int]:
    """The first id of each shard of ``small(csv)``."""
    from distml.data.preprocess import plan, read_shard

    return [read_shard(s)["id"][0].as_py() for s in plan(small(csv))]


@pytest.mark.distributed
def test_failed_shard_is_retried_and_a_slow_one_gets_a_backup(csv, oracle, tmp_path, monkeypatch):
    ids = read_table_ids(csv)
    monkeypatch.setenv("PP_MARKERS", str(tmp_path))
    monkeypatch.setenv("PP_RAISE_AT", str(ids[1]))
    monkeypatch.setenv("PP_SLOW_AT", str(ids[2]))
    monkeypatch.setenv("PP_SLOW_S", "20")
    monkeypatch.setenv("PP_DELAY_S", "0.05")
    start = time.monotonic()
    result = preprocess(
        small(csv), FAULTY, tmp_path / "out", workers=2, speculate_after=2.0, lease_s=30
    )
    assert time.monotonic() - start < 20  # the backup copy finished; the slow one was not awaited
    assert result.stats["retried"] == 1 and result.stats["speculative"] >= 1
    assert read_table(tmp_path / "out").equals(oracle)


@pytest.mark.distributed
def test_a_shard_that_always_fails_stops_the_job_and_a_rerun_finishes_it(
    csv, oracle, tmp_path, monkeypatch
):
    ids = read_table_ids(csv)
    monkeypatch.setenv("PP_ALWAYS_FAIL_AT", str(ids[3]))
    with pytest.raises(
        PreprocessError,
        match=rf"shard 3 failed on local-\d-\d+: ValueError: row {ids[3]} is corrupt",
    ) as e:
        preprocess(small(csv), FAULTY, tmp_path / "out", workers=2, max_attempts=2)
    assert "rerun the same job" in str(e.value)
    kept = len((tmp_path / "out/_done.jsonl").read_text().splitlines())
    assert kept >= 3
    monkeypatch.delenv("PP_ALWAYS_FAIL_AT")
    result = preprocess(small(csv), FAULTY, tmp_path / "out", workers=2)
    assert result.skipped == kept
    assert read_table(tmp_path / "out").equals(oracle)


@pytest.mark.distributed
def test_a_transform_whose_schema_drifts_is_refused(csv, tmp_path):
    with pytest.raises(PreprocessError, match="the transform must return one schema"):
        preprocess(small(csv), f"{HERE / 'transforms.py'}:schema_drift", tmp_path / "o", workers=1)


@pytest.mark.distributed
def test_another_jobs_folder_and_a_missing_transform_are_refused(csv, tmp_path):
    preprocess(small(csv), FEATURES, tmp_path / "out", workers=1)
    with pytest.raises(OutputError, match="holds the output of another job"):
        preprocess(small(csv), FAULTY, tmp_path / "out", workers=1)
    with pytest.raises(PreprocessError, match="has no function 'nope'"):
        preprocess(small(csv), f"{HERE / 'transforms.py'}:nope", tmp_path / "o2", workers=1)


@pytest.mark.distributed
def test_a_transform_that_does_not_import_stops_the_job_at_once(csv, tmp_path):
    """A SyntaxError is the user's to fix: the worker exits 2 and the job stops with its words,
    rather than restarting workers that would fail the same way."""
    bad = tmp_path / "bad.py"
    bad.write_text("def transform(table:\n")
    with pytest.raises(PreprocessError, match=r"local worker \d exited with 2: .*SyntaxError") as e:
        preprocess(small(csv), f"{bad}:transform", tmp_path / "out", workers=2)
    assert str(bad) in str(e.value)


@pytest.mark.distributed
def test_parquet_sql_and_file_sources(csv, oracle, tmp_path):
    table = pacsv.read_csv(csv)
    pq.write_table(table, tmp_path / "rows.parquet", row_group_size=500)
    source = ParquetSource(paths=[str(tmp_path / "rows.parquet")], row_groups_per_shard=2)
    preprocess(source, FEATURES, tmp_path / "from-parquet", workers=2)
    assert read_table(tmp_path / "from-parquet").equals(oracle)
    assert len(read_manifest(tmp_path / "from-parquet")["parts"]) == 3

    db = tmp_path / "rows.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE rows (id INTEGER PRIMARY KEY, a REAL, b REAL, label INTEGER)")
        shuffled = np.random.default_rng(1).permutation(ROWS)  # stored out of order
        rows = table.to_pylist()
        conn.executemany(
            "INSERT INTO rows VALUES (:id, :a, :b, :label)", [rows[i] for i in shuffled]
        )
    sql = SqlSource(url=f"sqlite:///{db}", table="rows", key="id", rows_per_shard=700)
    preprocess(sql, FEATURES, tmp_path / "from-sql", workers=2)
    assert read_table(tmp_path / "from-sql").equals(oracle)

    for i in range(5):
        (tmp_path / "files" / f"sub{i % 2}").mkdir(parents=True, exist_ok=True)
        (tmp_path / "files" / f"sub{i % 2}" / f"f{i}.txt").write_text("x" * i)
    files = FilesSource(pattern=str(tmp_path / "files"), files_per_shard=2)
    preprocess(files, f"{HERE / 'transforms.py'}:file_sizes", tmp_path / "from-files", workers=1)
    out = read_table(tmp_path / "from-files").to_pydict()
    assert sorted(zip(out["name"], out["size"], strict=True)) == [
        (f"f{i}.txt", i) for i in range(5)
    ]


@pytest.mark.parametrize("text", ["id,text\n", ""], ids=["header-only", "empty"])
def test_a_csv_without_rows_is_refused_by_name(tmp_path, text):
    path = tmp_path / "rows.csv"
    path.write_text(text)
    with pytest.raises(SourceError, match="holds no input"):
        plan(CsvSource(path=str(path)))
