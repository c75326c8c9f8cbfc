"""distml's data-parallel step vs a hand-written plain torch DDP script, same model and data.

    python benchmarks/ddp_overhead.py                 # 5 interleaved repeats of each
    python benchmarks/ddp_overhead.py --repeats 9 --steps 400

Both sides run ``nproc`` processes on the CPU (gloo), one thread each, started by torch's
``elastic_launch`` (distml through ``distml.launch``, the plain script directly), train the same
MLP on the same fixed random batches with SGD (the plain loop also reads the loss, as
``ctx.train_step`` does), and time ``--steps`` steady-state steps on rank 0
after ``--warmup`` untimed steps and a barrier. distml runs with its telemetry on (the accounted
comm hook and the per-step recorder). Repeats alternate the two (ABBA order); the result is the
median throughput of each and their ratio. Goal: distml / plain >= 0.97.

On a shared machine: each run waits until the CPUs are quiet (``--quiet``, ``--max-wait``), and
a run during which other processes took more than ``--max-foreign`` of the machine's CPU time
is redone (``--retries``); each run's share and attempts are printed and kept in the JSON.
"""

from __future__ import annotations

import argparse
import gc
import socket
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
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
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from torch.nn.parallel import DistributedDataParallel as DDP

import distml

SUMMARY_KEYS = ("samples_per_s", "compute_s", "comm_s", "sync_wait_s", "comm_bytes", "steps")


def make_model(sizes: list[int]) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def plain_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """The plain peer: what one would write by hand with torch.distributed and DDP."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    result = _plain_train(cfg)
    gc.collect()
    # DDP is gone by now. Had its reducer held the group's last reference, destroying the group
    # here could deadlock: gloo's destructor, run with the GIL held, waits for a worker thread
    # that is freeing the last collective's tensors and needs the GIL (pytorch issue 56297).
    dist.destroy_process_group()
    return result


def _plain_train(cfg: dict[str, Any]) -> dict[str, Any]:
    model = DDP(make_model(cfg["sizes"]))
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    sizes = cfg["sizes"]
    batches = random_batches(16, cfg["batch"], (sizes[0],), sizes[-1], 1000 + dist.get_rank())

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return timed_steps(step, batches, cfg["warmup"], cfg["steps"])


def distml_worker(ctx: distml.Context, cfg: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    model = make_model(cfg["sizes"])
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    model, opt = ctx.setup(model, opt)
    sizes = cfg["sizes"]
    batches = random_batches(16, cfg["batch"], (sizes[0],), sizes[-1], 1000 + ctx.rank)

    def loss_of(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(model(batch[0]), batch[1])

    result = timed_steps(lambda b: ctx.train_step(b, loss_of), batches, cfg["warmup"], cfg["steps"])
    summary = ctx.finish()
    result["summary"] = {k: summary[k] for k in SUMMARY_KEYS}
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_plain(cfg: dict[str, Any], nproc: int, tmp: Path, i: int) -> dict[str, Any]:
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"plain-{i}-{time.time_ns()}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        max_restarts=0,
        monitor_interval=0.1,  # as distml's launcher
        start_method="spawn",
        local_addr="127.0.0.1",
        logs_specs=DefaultLogsSpecs(log_dir=str(tmp / f"plain-logs-{i}-{time.time_ns()}")),
    )
    return elastic_launch(config, plain_worker)(cfg)[0]


def run_distml(cfg: dict[str, Any], nproc: int, tmp: Path, i: int) -> dict[str, Any]:
    return distml.launch(
        distml_worker,
        cfg,
        nproc=nproc,
        run_name=f"distml-{i}-{time.time_ns()}",
        runs_dir=tmp,
        telemetry={"progress": False},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each side")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps per run")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64, help="per rank")
    parser.add_argument("--sizes", default="784,1024,1024,10", help="MLP layer widths")
    add_noise_args(parser)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    cfg = {
        "sizes": sizes,
        "batch": args.batch,
        "lr": 0.01,
        "warmup": args.warmup,
        "steps": args.steps,
    }
    runners = {"distml": run_distml, "plain": run_plain}
    runs: dict[str, list[dict[str, Any]]] = {"distml": [], "plain": []}
    info = machine_info()
    with scratch_dir("distml-overhead-") as tmp:
        for r in range(args.repeats):
            order = ("distml", "plain") if r % 2 == 0 else ("plain", "distml")  # ABBA
            for name in order:
                res = measured(partial(runners[name], cfg, args.nproc, tmp, r), args)
                samples = args.steps * args.batch * args.nproc
                run = {
                    "repeat": r,
                    "samples_per_s": samples / res["wall_s"],
                    "median_step_ms": 1e3 * median(res.pop("step_s")),
                    **res,
                }
                runs[name].append(run)
                print(
                    f"repeat {r} {name:6s} {run['samples_per_s']:9,.0f} samples/s  "
                    f"median step {run['median_step_ms']:.2f} ms  cpu/wall "
                    f"{'/'.join(f'{c:.2f}' for c in res['cpu_per_wall'])}  foreign "
                    f"{res['foreign_share']:.1%}  attempts {res['attempts']}"
                )
    med = {k: median([x["samples_per_s"] for x in v]) for k, v in runs.items()}
    step_ms = {k: median([x["median_step_ms"] for x in v]) for k, v in runs.items()}
    pair_ratios = [
        d["samples_per_s"] / p["samples_per_s"]
        for d, p in zip(runs["distml"], runs["plain"], strict=True)
    ]
    ratio = med["distml"] / med["plain"]
    foreign = median([x["foreign_share"] for v in runs.values() for x in v])
    rows = [
        [
            k,
            f"{med[k]:,.0f}",
            spread([x["samples_per_s"] for x in runs[k]]),
            f"{step_ms[k]:.2f}",
            f"{med[k] / med['plain']:.3f}",
        ]
        for k in ("plain", "distml")
    ]
    print_table(
        f"DDP step overhead: {args.nproc} procs x batch {args.batch}, MLP {args.sizes}, "
        f"{args.steps} steps x {args.repeats} repeats; noise: median foreign CPU {foreign:.1%}",
        ["side", "median samples/s", "min..max", "median step ms", "vs plain"],
        rows,
    )
    print(
        f"distml / plain throughput: {ratio:.3f} (median of per-repeat ratios "
        f"{median(pair_ratios):.3f}; goal >= 0.97: {'met' if ratio >= 0.97 else 'NOT met'})"
    )
    path = write_json(
        "ddp_overhead",
        {
            "benchmark": "ddp_overhead",
            "machine": info,
            "args": vars(args),
            "median_samples_per_s": med,
            "median_step_ms": step_ms,
            "ratio": ratio,
            "pair_ratios": pair_ratios,
            "median_pair_ratio": median(pair_ratios),
            "median_foreign_share": foreign,
            "goal_ratio": 0.97,
            "met": ratio >= 0.97,
            "runs": runs,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
