"""Preprocessing's fixed cost: a job whose shards take a known time, against its ideal schedule.

    python benchmarks/preprocess_overhead.py                 # 3 shards of 0.3 s, 2 workers, 7 runs
    python benchmarks/preprocess_overhead.py --shards 5 --shard-s 0.5 --runs 9

Each shard's transform sleeps ``--shard-s`` (no CPU: the machine's noise stays out), so a job on
W workers needs ceil(shards / W) x shard-s at best. The rest is what distml adds: the coordinator's
server, the workers' start-up, the claims and reports, and the end of the job (an idle worker
hearing "stop", the workers exiting). Reported: the median job time, the ideal, and their
difference.
"""

from __future__ import annotations

import argparse
import math
import time

from _common import machine_info, median, print_table, scratch_dir, spread, write_json

from distml.data.preprocess import CsvSource, plan, preprocess

TRANSFORM = """import time


def slow(table):
    time.sleep({seconds})
    return table
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=3)
    parser.add_argument("--shard-s", type=float, default=0.3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    with scratch_dir("preprocess-overhead") as tmp:
        (tmp / "slow.py").write_text(TRANSFORM.format(seconds=args.shard_s))
        csv = tmp / "rows.csv"
        csv.write_text("a,b\n" + "".join(f"{i},{2 * i}\n" for i in range(1000 * args.shards)))
        source = CsvSource(path=str(csv), blocksize=csv.stat().st_size // args.shards + 1)
        shards = len(plan(source))
        times = []
        for run in range(args.runs):
            start = time.perf_counter()
            preprocess(source, f"{tmp / 'slow.py'}:slow", tmp / f"out-{run}", workers=args.workers)
            times.append(time.perf_counter() - start)
    ideal = math.ceil(shards / args.workers) * args.shard_s
    out = {
        "machine": machine_info(),
        "args": vars(args),
        "shards": shards,
        "seconds": times,
        "median_s": median(times),
        "ideal_s": ideal,
        "overhead_s": median(times) - ideal,
    }
    print_table(
        f"{shards} shards of {args.shard_s} s on {args.workers} workers",
        ["job", "median s", "min..max"],
        [
            ["distml.data.preprocess.preprocess", f"{out['median_s']:.2f}", spread(times)],
            ["ideal schedule", f"{ideal:.2f}", "-"],
            ["overhead", f"{out['overhead_s']:.2f}", "-"],
        ],
    )
    print(f"results: {write_json('preprocess_overhead', out)}")


if __name__ == "__main__":
    main()
