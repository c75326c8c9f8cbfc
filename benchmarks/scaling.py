"""Scaling: 2 distml workers vs 1 on a compute-bound CNN, one thread per worker (weak scaling).

    python benchmarks/scaling.py                      # 3 interleaved repeats of each
    python benchmarks/scaling.py --repeats 5 --steps 60 --batch 64
    python benchmarks/scaling.py --pin                # worker i on core i (sched_setaffinity)

Each worker trains the same small CNN (3x32x32 inputs, ~0.1 M parameters, so ~0.4 MB of
gradients against ~0.1 s of compute a step) on its own fixed random batches of ``--batch``
samples, with ``torch.set_num_threads(1)``. Throughput is global samples/s over ``--steps``
timed steps on rank 0 (after ``--warmup`` untimed steps and a barrier). speed-up =
throughput(2) / throughput(1), efficiency = speed-up / 2. Where the rest went comes from distml's
own per-step telemetry (metrics.jsonl, timed steps only, mean over ranks): compute, exposed
communication proper, and synchronisation wait, per step. Goal: speed-up >= 1.8.

On a shared machine: each run waits until the CPUs are quiet (``--quiet``, ``--max-wait``), and
a run during which other processes took more than ``--max-foreign`` of the machine's CPU time
is redone (``--retries``); each run's share and attempts are printed and kept in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _common import (
    add_noise_args,
    machine_info,
    measured,
    median,
    print_table,
    random_batches,
    scratch_dir,
    spread,
    timed_steps,
    write_json,
)
from torch import nn

import distml

PARTS = ("step_s", "compute_s", "comm_s", "sync_wait_s")
SUMMARY_KEYS = ("samples_per_s", "train_s", "compute_s", "comm_s", "sync_wait_s", "comm_bytes")


def make_cnn(c: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, c, 3, padding=1), nn.ReLU(),
        nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(2 * c, 2 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(2 * c * 8 * 8, 10),
    )  # fmt: skip


def worker(ctx: distml.Context, cfg: dict[str, Any]) -> dict[str, Any]:
    if cfg["pin"] and hasattr(os, "sched_setaffinity"):  # one core per worker
        os.sched_setaffinity(0, {ctx.local_rank % (os.cpu_count() or 1)})
    torch.set_num_threads(1)
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = ctx.setup(model, opt)
    batches = random_batches(8, cfg["batch"], (3, 32, 32), 10, 1000 + ctx.rank)

    def loss_of(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(model(batch[0]), batch[1])

    result = timed_steps(lambda b: ctx.train_step(b, loss_of), batches, cfg["warmup"], cfg["steps"])
    summary = ctx.finish()
    result["summary"] = {k: summary[k] for k in SUMMARY_KEYS}
    if ctx.rank == 0:  # metrics.jsonl holds every rank's records, with waits attributed
        lines = (ctx.run_dir / "metrics.jsonl").read_text().splitlines()
        timed = [r for r in map(json.loads, lines) if r["step"] >= cfg["warmup"]]
        result["per_step"] = {p: sum(r[p] for r in timed) / len(timed) for p in PARTS}
    return result


def run_once(cfg: dict[str, Any], nproc: int, tmp: Path, r: int) -> dict[str, Any]:
    res = distml.launch(
        worker,
        cfg,
        nproc=nproc,
        run_name=f"scaling-{nproc}-{r}-{time.time_ns()}",
        runs_dir=tmp,
        telemetry={"progress": False},
    )
    return {
        "repeat": r,
        "samples_per_s": cfg["steps"] * cfg["batch"] * nproc / res["wall_s"],
        "median_step_ms": 1e3 * median(res.pop("step_s")),
        "per_step_ms": {p: 1e3 * v for p, v in res.pop("per_step").items()},
        **res,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each world size")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per run")
    parser.add_argument("--batch", type=int, default=64, help="per worker")
    parser.add_argument("--pin", action="store_true", help="pin worker i to CPU core i")
    add_noise_args(parser)
    args = parser.parse_args()
    cfg = {"batch": args.batch, "warmup": args.warmup, "steps": args.steps, "pin": args.pin}
    runs: dict[int, list[dict[str, Any]]] = {1: [], 2: []}
    info = machine_info()
    with scratch_dir("distml-scaling-") as tmp:
        for r in range(args.repeats):
            for nproc in (1, 2) if r % 2 == 0 else (2, 1):  # ABBA
                run = measured(partial(run_once, cfg, nproc, tmp, r), args)
                runs[nproc].append(run)
                ms = run["per_step_ms"]
                print(
                    f"repeat {r} nproc {nproc}: {run['samples_per_s']:7,.1f} samples/s  "
                    f"step {ms['step_s']:.1f} = compute {ms['compute_s']:.1f} + comm "
                    f"{ms['comm_s']:.2f} + wait {ms['sync_wait_s']:.2f} ms  "
                    f"cpu/wall {'/'.join(f'{c:.2f}' for c in run['cpu_per_wall'])}  "
                    f"foreign {run['foreign_share']:.1%}  attempts {run['attempts']}"
                )
    tput = {n: median([x["samples_per_s"] for x in v]) for n, v in runs.items()}
    parts = {
        n: {p: median([x["per_step_ms"][p] for x in v]) for p in PARTS} for n, v in runs.items()
    }
    speedup = tput[2] / tput[1]
    pair_speedups = [
        b["samples_per_s"] / a["samples_per_s"] for a, b in zip(runs[1], runs[2], strict=True)
    ]
    rows = []
    for n in (1, 2):
        ms = parts[n]
        frac = {p: ms[p] / ms["step_s"] for p in PARTS}
        rows.append(
            [
                str(n),
                f"{tput[n]:,.1f}",
                spread([x["samples_per_s"] for x in runs[n]]),
                f"{ms['step_s']:.1f}",
                f"{ms['compute_s']:.1f} ({frac['compute_s']:.1%})",
                f"{ms['comm_s']:.2f} ({frac['comm_s']:.1%})",
                f"{ms['sync_wait_s']:.2f} ({frac['sync_wait_s']:.1%})",
            ]
        )
    print_table(
        f"Weak scaling: CNN, batch {args.batch}/worker, 1 thread/worker{', pinned' * args.pin}, "
        f"{args.steps} steps x {args.repeats} repeats (medians; ms per step, rank mean)",
        ["workers", "samples/s", "min..max", "step ms", "compute ms", "comm ms", "wait ms"],
        rows,
    )
    # Weak scaling: ideally a 2-worker step takes as long as a 1-worker step.
    lost = {
        "step_ms_over_1_worker": parts[2]["step_s"] - parts[1]["step_s"],
        "compute_inflation_ms": parts[2]["compute_s"] - parts[1]["compute_s"],
        "comm_ms": parts[2]["comm_s"],
        "sync_wait_ms": parts[2]["sync_wait_s"],
    }
    print(
        f"speed-up 2 vs 1: {speedup:.2f}x (median of per-repeat {median(pair_speedups):.2f}x), "
        f"efficiency {speedup / 2:.1%}; goal >= 1.8x: {'met' if speedup >= 1.8 else 'NOT met'}"
    )
    print(
        "extra time per 2-worker step: {step_ms_over_1_worker:.1f} ms = compute slower by "
        "{compute_inflation_ms:.1f} + comm {comm_ms:.2f} + wait {sync_wait_ms:.2f}".format(**lost)
    )
    path = write_json(
        "scaling_pinned" if args.pin else "scaling",
        {
            "benchmark": "scaling",
            "machine": info,
            "args": vars(args),
            "median_samples_per_s": tput,
            "speedup": speedup,
            "efficiency": speedup / 2,
            "pair_speedups": pair_speedups,
            "median_per_step_ms": parts,
            "lost_per_step_ms": lost,
            "goal_speedup": 1.8,
            "met": speedup >= 1.8,
            "runs": runs,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
