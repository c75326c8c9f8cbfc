"""Distributed preprocessing: 2 workers vs 1 on a CPU-bound transform, against Dask, same run.

    python benchmarks/preprocess.py                  # 1,000,000 rows, 3 repeats
    python benchmarks/preprocess.py --rows 50000 --repeats 1

The job: a CSV of short texts cut into 16 shards, each feature-hashed (pure Python: the
transform of ``examples/preprocess/features.py``) and written as Parquet. Rows, interleaved in
each repeat:
- one process: the same shards read, transformed and written in a loop, no coordinator;
- distml with 1 and 2 local workers (``distml.data.preprocess.preprocess``), worker start-up
  included, as a user waits for it;
- Dask (``dask.bag`` over the same shards, the multiprocessing scheduler, 2 processes), the
  peer engine, running the same read-transform-write function.
Every output is checked against the one-process output. Goal: distml 2 workers >= 1.8x 1.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from _common import machine_info, median, print_table, scratch_dir, write_json

from distml.data.preprocess import CsvSource, plan, preprocess, read_shard, read_table
from distml.data.preprocess.worker import as_table

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "preprocess"
TRANSFORM = f"{EXAMPLE / 'features.py'}:hashed_features"


def example():
    """The example's module; Dask's worker processes import it too, hence the path here."""
    if str(EXAMPLE) not in sys.path:
        sys.path.insert(0, str(EXAMPLE))
    import features

    return features


def run_shard(shard: dict, out: str) -> int:
    """Read, transform and write one shard: what every engine here runs per shard."""
    table = as_table(example().hashed_features(read_shard(shard)))
    pq.write_table(table, f"{out}/part-{shard['id']:05d}.parquet")
    return table.num_rows


def one_process(shards: list[dict], out: Path) -> float:
    out.mkdir()
    start = time.perf_counter()
    for shard in shards:
        run_shard(shard, str(out))
    return time.perf_counter() - start


def with_distml(source: CsvSource, out: Path, workers: int) -> float:
    start = time.perf_counter()
    preprocess(source, TRANSFORM, out, workers=workers)
    return time.perf_counter() - start


def with_dask(shards: list[dict], out: Path, workers: int) -> float:
    import dask.bag as db

    out.mkdir()
    start = time.perf_counter()
    bag = db.from_sequence(shards, npartitions=len(shards)).map(run_shard, str(out))
    bag.compute(scheduler="processes", num_workers=workers)
    return time.perf_counter() - start


def read_parts(out: Path, shards: int) -> pa.Table:
    return pa.concat_tables(pq.read_table(out / f"part-{i:05d}.parquet") for i in range(shards))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    times: dict[str, list[float]] = {}
    with scratch_dir("preprocess-bench") as tmp:
        csv = tmp / "texts.csv"
        example().write_sample(str(csv), args.rows)
        source = CsvSource(path=str(csv), blocksize=max(1024, csv.stat().st_size // args.shards))
        shards = plan(source)
        reference = None
        for repeat in range(args.repeats):
            runs: dict[str, Any] = {
                "one process": lambda out: one_process(shards, out),
                "distml, 1 worker": lambda out: with_distml(source, out, 1),
                "distml, 2 workers": lambda out: with_distml(source, out, 2),
                "dask, 2 processes": lambda out: with_dask(shards, out, 2),
            }
            for name, run in runs.items():
                out = tmp / f"out-{repeat}-{len(times.get(name, []))}-{name.split(',')[0]}"
                seconds = run(out)
                table = (
                    read_table(out) if name.startswith("distml") else read_parts(out, len(shards))
                )
                reference = reference if reference is not None else table
                assert table.equals(reference), f"{name} gave another output"
                times.setdefault(name, []).append(seconds)
                print(f"repeat {repeat} {name}: {seconds:.2f} s", flush=True)
                shutil.rmtree(out)
    medians = {name: median(ts) for name, ts in times.items()}
    base = medians["one process"]
    out = {
        "machine": machine_info(),
        "args": vars(args),
        "shards": len(shards),
        "seconds": times,
        "median_s": medians,
        "distml_2_vs_1": medians["distml, 1 worker"] / medians["distml, 2 workers"],
        "distml_vs_dask": medians["dask, 2 processes"] / medians["distml, 2 workers"],
    }
    print_table(
        f"Preprocessing {args.rows:,} texts in {len(shards)} shards "
        f"(distml 2 vs 1 workers: {out['distml_2_vs_1']:.2f}x; "
        f"vs dask: {out['distml_vs_dask']:.2f}x)",
        ["engine", "median s", "rows/s", "vs one process"],
        [
            [name, f"{m:.2f}", f"{args.rows / m:,.0f}", f"{base / m:.2f}x"]
            for name, m in medians.items()
        ],
    )
    print(f"results: {write_json('preprocess', out)}")


if __name__ == "__main__":
    main()
