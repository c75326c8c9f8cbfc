"""Parameter server: consistency rules against a straggler, and server sharding.

    python benchmarks/parameter_server.py                  # both parts
    python benchmarks/parameter_server.py --part straggler --epochs 6
    python benchmarks/parameter_server.py --part shards --steps 30

Straggler part: the digits CNN (``examples/digits/train.py``) on 4 workers, rank 3 slowed to 2x
its compute (``--simulate-straggler 3:2``), under ASP, SSP(s=2), BSP, BSP with one backup
worker (each step takes the first 3 gradients of 4), Local SGD (H=4) and DDP all-reduce, in
one run. Throughput is the run's samples/s (every sample over the longest worker's step time);
time to target is rank 0's step time until its training loss (mean of the last 5 steps) is
<= ``--target-loss``; accuracy is the validation accuracy at the end. Goal: ASP and SSP
throughput >= 1.5x BSP's.

Shard part: 4 ASP workers on a model whose steps are server-bound (benchmarks/ps_server_bound.py:
~8.4 M parameters, batch 4), with 1 and with 2 server shards: the speed-up of 2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from _common import machine_info, print_table, scratch_dir, write_json

HERE = Path(__file__).resolve().parent
DIGITS = HERE.parent / "examples" / "digits" / "train.py"

STRATEGIES: dict[str, list[str]] = {
    "asp": ["--strategy", "ps", "--consistency", "asp"],
    "ssp:2": ["--strategy", "ps", "--consistency", "ssp:2"],
    "bsp": ["--strategy", "ps", "--consistency", "bsp"],
    "bsp+1 backup": ["--strategy", "ps", "--consistency", "bsp", "--backup-workers", "1"],
    "local-sgd:4": ["--strategy", "local-sgd:4"],
    "ddp": ["--strategy", "ddp"],
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


def straggler_part(args: argparse.Namespace, runs_dir: Path) -> list[dict[str, Any]]:
    rows = []
    for name, flags in STRATEGIES.items():
        run = name.replace(":", "-").replace("+", "-").replace(" ", "-")
        summary = distml_run(
            runs_dir, run, ["--nproc", "4", "--simulate-straggler", "3:2", *flags],
            [str(DIGITS), "--epochs", str(args.epochs)],
        )  # fmt: skip
        rows.append(
            {
                "strategy": name,
                "samples_per_s": summary["samples_per_s"],
                "time_to_target_s": time_to_loss(runs_dir / run, args.target_loss),
                "accuracy": summary["eval"]["accuracy"],
                "sync_wait_s": summary["sync_wait_s"],
                "staleness": summary.get("ps", {}).get("staleness"),
            }
        )
        print(f"{name}: {rows[-1]['samples_per_s']:.0f} samples/s", file=sys.stderr)
    bsp = next(r["samples_per_s"] for r in rows if r["strategy"] == "bsp")
    for r in rows:
        r["vs_bsp"] = r["samples_per_s"] / bsp
    return rows


def shard_part(args: argparse.Namespace, runs_dir: Path) -> list[dict[str, Any]]:
    rows = []
    for servers in (1, 2):
        summary = distml_run(
            runs_dir, f"shards{servers}",
            ["--nproc", "4", "--strategy", "ps", "--consistency", "asp", "--servers", str(servers)],
            [str(HERE / "ps_server_bound.py"), str(args.steps)],
        )  # fmt: skip
        shards = summary["ps"]["shards"]
        rows.append(
            {
                "servers": servers,
                "samples_per_s": summary["samples_per_s"],
                "apply_s_median": statistics.fmean(s["apply_s"]["median"] for s in shards),
                "queue_s_total": sum(s["queue_s"]["total"] for s in shards),
                "param_bytes": [s["param_bytes"] for s in shards],
            }
        )
    rows[1]["speedup"] = rows[1]["samples_per_s"] / rows[0]["samples_per_s"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["straggler", "shards", "both"], default="both")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--target-loss", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    out: dict[str, Any] = {"machine": machine_info(), "args": vars(args)}
    with scratch_dir("distml-bench-ps-") as runs_dir:
        if args.part in ("straggler", "both"):
            rows = out["straggler"] = straggler_part(args, runs_dir)
            print_table(
                "4 workers, rank 3 at 2x compute (digits CNN)",
                ["strategy", "samples/s", "vs BSP", f"time to loss {args.target_loss} (s)",
                 "val accuracy", "sync wait (s)"],
                [[r["strategy"], f"{r['samples_per_s']:,.0f}", f"{r['vs_bsp']:.2f}",
                  "-" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.2f}",
                  f"{r['accuracy']:.3f}", f"{r['sync_wait_s']:.2f}"] for r in rows],
            )  # fmt: skip
        if args.part in ("shards", "both"):
            rows = out["shards"] = shard_part(args, runs_dir)
            print_table(
                "4 ASP workers, server-bound model: 1 vs 2 shards",
                ["servers", "samples/s", "apply (median s)", "queue (total s)", "speed-up"],
                [[str(r["servers"]), f"{r['samples_per_s']:,.1f}", f"{r['apply_s_median']:.4f}",
                  f"{r['queue_s_total']:.2f}", f"{r.get('speedup', 1.0):.2f}"] for r in rows],
            )  # fmt: skip
    print(f"results: {write_json('parameter_server', out)}")


if __name__ == "__main__":
    main()
