"""Parameter server: consistency rules against a straggler, against DDP, and server sharding.

    python benchmarks/parameter_server.py                  # both parts, 3 interleaved repeats
    python benchmarks/parameter_server.py --part straggler --epochs 6 --all-rules
    python benchmarks/parameter_server.py --part shards --steps 30 --repeats 5

Straggler part: the digits CNN (``examples/digits/train.py``, batch 32 a worker) on 4 workers.
In every repeat, one run of each row, in turn: ASP and BSP with rank 3 slowed to 2x its compute
(``--simulate-straggler 3:2``); BSP and DDP all-reduce with no straggler; with ``--all-rules``
also SSP(s=2), BSP with one backup worker (each step takes the first 3 gradients of 4), Local
SGD (H=4) and DDP with the straggler. Throughput is the run's samples/s (every sample over the
longest worker's step time); transport is the share of a parameter-server worker's step spent
pushing and pulling (its exposed communication less the time the consistency rule held it;
the fast ranks' median); time to target is rank 0's step time until its training loss (mean of
the last 5 steps) is <= ``--target-loss``; accuracy is the validation accuracy at the end.
Ratios are taken within each repeat, then the median. Goals: transport <= 30% of a step; ASP
>= 1.4x BSP against the straggler; BSP >= 0.9x DDP with none.

Shard part: 4 ASP workers on a model whose steps are server-bound (benchmarks/ps_server_bound.py:
6.3 M parameters, batch 4), with 1 and with 2 server shards, interleaved: the speed-up of 2.
Goal: >= 1.8x.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from _common import machine_info, print_table, scratch_dir, write_json

HERE = Path(__file__).resolve().parent
DIGITS = HERE.parent / "examples" / "digits" / "train.py"

PS = ["--strategy", "ps", "--consistency"]
STRAGGLER = ["--simulate-straggler", "3:2"]
# name -> flags; the goal rows first, then those of --all-rules.
ROWS: dict[str, list[str]] = {
    "asp, straggler": [*PS, "asp", *STRAGGLER],
    "bsp, straggler": [*PS, "bsp", *STRAGGLER],
    "bsp": [*PS, "bsp"],
    "ddp": ["--strategy", "ddp"],
}
ALL_RULES: dict[str, list[str]] = {
    "ssp:2, straggler": [*PS, "ssp:2", *STRAGGLER],
    "bsp+1 backup, straggler": [*PS, "bsp", "--backup-workers", "1", *STRAGGLER],
    "local-sgd:4, straggler": ["--strategy", "local-sgd:4", *STRAGGLER],
    "ddp, straggler": ["--strategy", "ddp", *STRAGGLER],
}


def distml_run(runs_dir: Path, name: str, flags: list[str], script: list[str]) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "distml", "run", "--runs-dir", str(runs_dir), "--run-name", name,
           *flags, *script]  # fmt: skip
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    if result.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{result.stderr[-3000:]}")
    return json.loads((runs_dir / name / "summary.json").read_text())


def time_to_loss(run_dir: Path, target: float) -> float | None:
    """Rank 0's step time until the mean loss of its last 5 steps is <= target."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    records = sorted((r for r in records if r["rank"] == 0), key=lambda r: r["step"])
    elapsed, window = 0.0, []
    for r in records:
        elapsed += r["step_s"]
        window = (window + [r["loss"]])[-5:]
        if len(window) == 5 and statistics.fmean(window) <= target:
            return elapsed
    return None


def transport_share(run_dir: Path, ranks: list[int]) -> dict[str, float] | None:
    """The share of a step a parameter-server worker spent pushing and pulling (``comm``) and
    waiting on the consistency rule (``wait``): the median over ``ranks`` of each rank's sums."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    comm, wait = [], []
    for rank in ranks:
        mine = [r for r in records if r["rank"] == rank]
        steps = sum(r["step_s"] for r in mine)
        comm.append(sum(r["comm_s"] for r in mine) / steps)
        wait.append(sum(r["sync_wait_s"] for r in mine) / steps)
    return {"comm": statistics.median(comm), "wait": statistics.median(wait)}


def straggler_part(args: argparse.Namespace, runs_dir: Path) -> dict[str, Any]:
    rows = ROWS | (ALL_RULES if args.all_rules else {})
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in rows}
    for repeat in range(args.repeats):
        for name, flags in rows.items():
            run = f"{re.sub(r'[^A-Za-z0-9]+', '-', name)}-{repeat}"
            summary = distml_run(
                runs_dir, run, ["--nproc", "4", *flags],
                [str(DIGITS), "--epochs", str(args.epochs)],
            )  # fmt: skip
            fast = [0, 1, 2] if "straggler" in name else [0, 1, 2, 3]
            runs[name].append(
                {
                    "samples_per_s": summary["samples_per_s"],
                    "time_to_target_s": time_to_loss(runs_dir / run, args.target_loss),
                    "accuracy": summary["eval"]["accuracy"],
                    "sync_wait_s": summary["sync_wait_s"],
                    "transport": transport_share(runs_dir / run, fast) if "ps" in flags else None,
                    "staleness": summary.get("ps", {}).get("staleness"),
                }
            )
            print(
                f"{name} ({repeat + 1}): {summary['samples_per_s']:.0f} samples/s", file=sys.stderr
            )
    ratios = {
        "asp_vs_bsp_straggler": [
            a["samples_per_s"] / b["samples_per_s"]
            for a, b in zip(runs["asp, straggler"], runs["bsp, straggler"], strict=True)
        ],
        "bsp_vs_ddp": [
            a["samples_per_s"] / b["samples_per_s"]
            for a, b in zip(runs["bsp"], runs["ddp"], strict=True)
        ],
    }
    return {"runs": runs, "ratios": ratios}


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def straggler_table(part: dict[str, Any], target: float) -> None:
    rows = []
    for name, runs in part["runs"].items():
        samples = [r["samples_per_s"] for r in runs]
        shares = [r["transport"] for r in runs if r["transport"] is not None]
        ttl = _median([r["time_to_target_s"] for r in runs])
        rows.append(
            [
                name,
                f"{statistics.median(samples):,.0f}",
                f"{min(samples):,.0f}..{max(samples):,.0f}",
                f"{statistics.median(s['comm'] for s in shares):.2f}" if shares else "-",
                f"{statistics.median(s['wait'] for s in shares):.2f}" if shares else "-",
                "-" if ttl is None else f"{ttl:.2f}",
                f"{statistics.median(r['accuracy'] for r in runs):.3f}",
            ]
        )
    print_table(
        "digits CNN, 4 workers (straggler: rank 3 at 2x compute), median of repeats",
        ["row", "samples/s", "range", "transport share", "rule-wait share",
         f"time to loss {target} (s)", "val accuracy"],
        rows,
    )  # fmt: skip
    print_table(
        "ratios within each repeat",
        ["ratio", "median", "each repeat"],
        [
            [name, f"{statistics.median(values):.2f}", ", ".join(f"{v:.2f}" for v in values)]
            for name, values in part["ratios"].items()
        ],
    )


def shard_part(args: argparse.Namespace, runs_dir: Path) -> dict[str, Any]:
    runs: dict[int, list[dict[str, Any]]] = {1: [], 2: []}
    for repeat in range(args.repeats):
        for servers in (1, 2):
            summary = distml_run(
                runs_dir, f"shards{servers}-{repeat}",
                ["--nproc", "4", *PS, "asp", "--servers", str(servers)],
                [str(HERE / "ps_server_bound.py"), str(args.steps)],
            )  # fmt: skip
            shards = summary["ps"]["shards"]
            runs[servers].append(
                {
                    "samples_per_s": summary["samples_per_s"],
                    "apply_s_median": statistics.fmean(s["apply_s"]["median"] for s in shards),
                    "queue_s_total": sum(s["queue_s"]["total"] for s in shards),
                    "param_bytes": [s["param_bytes"] for s in shards],
                    "transport": transport_share(
                        runs_dir / f"shards{servers}-{repeat}", [0, 1, 2, 3]
                    ),
                }
            )
    speedups = [
        b["samples_per_s"] / a["samples_per_s"] for a, b in zip(runs[1], runs[2], strict=True)
    ]
    return {"runs": runs, "speedups": speedups}


def shard_table(part: dict[str, Any]) -> None:
    rows = []
    for servers, runs in part["runs"].items():
        rows.append(
            [
                str(servers),
                f"{statistics.median(r['samples_per_s'] for r in runs):,.1f}",
                f"{statistics.median(r['apply_s_median'] for r in runs):.4f}",
                f"{statistics.median(r['transport']['comm'] for r in runs):.2f}",
                f"{statistics.median(part['speedups']):.2f}" if servers == 2 else "1.00",
            ]
        )
    print_table(
        "4 ASP workers, server-bound model: 1 vs 2 shards, median of repeats",
        ["servers", "samples/s", "apply (median s)", "transport share", "speed-up"],
        rows,
    )
    print(f"speed-up in each repeat: {', '.join(f'{v:.2f}' for v in part['speedups'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["straggler", "shards", "both"], default="both")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--target-loss", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--all-rules", action="store_true", help="also SSP, backup, Local SGD")
    args = parser.parse_args()
    out: dict[str, Any] = {"machine": machine_info(), "args": vars(args)}
    with scratch_dir("distml-bench-ps-") as runs_dir:
        if args.part in ("straggler", "both"):
            out["straggler"] = straggler_part(args, runs_dir)
            straggler_table(out["straggler"], args.target_loss)
        if args.part in ("shards", "both"):
            out["shards"] = shard_part(args, runs_dir)
            shard_table(out["shards"])
    print(f"results: {write_json('parameter_server', out)}")


if __name__ == "__main__":
    main()
