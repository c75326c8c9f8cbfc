"""Every model-parallel layout on 4 processes: distml's step vs the same layout hand-written in
plain torch, in the same processes, and the memory each rank holds.

    python benchmarks/model_parallel.py [--steps 8] [--repeats 3] [--layouts fsdp4,tp4,...]

For each layout one world of 4 workers is launched; it builds the GPT twice from the same seed,
once through ``ctx.setup`` (distml: its accounting of collectives, memory and bubble on) and once
with torch's own calls written out here (``fully_shard``, ``parallelize_module``,
``PipelineStage`` + a schedule), and times them in interleaved blocks of ``--steps`` steps.
Throughput is samples per second; the figure is the median of the per-repeat ratios.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, median, print_table, scratch_dir, spread, write_json  # noqa: E402

import distml  # noqa: E402
from distml.config import GPTConfig  # noqa: E402
from distml.models import GPT, lm_loss  # noqa: E402

MODEL = GPTConfig(vocab_size=256, seq_len=64, layers=8, hidden=256, heads=8)
GLOBAL_BATCH = 16
MICROBATCHES = 8

LAYOUTS: dict[str, tuple[dict[str, int], dict]] = {
    "ddp4": ({"dp": 4}, {}),
    "fsdp4": ({"fsdp": 4}, {}),
    "fsdp4-zero2": ({"fsdp": 4}, {"reshard_after_forward": False}),
    "tp4": ({"tp": 4}, {}),
    "pp4": ({"pp": 4}, {}),
    "fsdp2xtp2": ({"fsdp": 2, "tp": 2}, {}),
    "fsdp2xtp2-full-ac": ({"fsdp": 2, "tp": 2}, {"activation_checkpointing": "full"}),
    "dp2xpp2": ({"dp": 2, "pp": 2}, {}),
    "tp2xpp2": ({"tp": 2, "pp": 2}, {}),
}


# -- the peer: the same layout written directly against torch ------------------------------
def plain_tp(model: GPT, mesh) -> None:
    plan = {
        "attn": PrepareModuleInput(
            input_layouts=(Replicate(),),
            desired_input_layouts=(Replicate(),),
            use_local_output=False,
        ),
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.out": RowwiseParallel(),
        "mlp.up": ColwiseParallel(),
        "mlp.down": RowwiseParallel(),
    }
    for block in model.blocks.values():
        parallelize_module(block, mesh, plan)


def plain_pp_stage(model: GPT, rank: int, stages: int) -> GPT:
    per = len(model.blocks) // stages
    for key in list(model.blocks):
        if not rank * per <= int(key) < (rank + 1) * per:
            del model.blocks[key]
    if rank != 0:
        model.embed = model.pos = None
    if rank != stages - 1:
        model.norm = model.head = None
    return model


def build_plain(ctx: distml.Context, par: dict):
    """The layout by hand: pipeline cut, then TP, then FSDP/HSDP; returns a step function."""
    layout, mesh = ctx.layout, ctx.mesh
    model = GPT(MODEL)
    if layout.pp > 1:
        model = plain_pp_stage(model, mesh["pp"].get_local_rank(), layout.pp)
    if layout.tp > 1:
        plain_tp(model, mesh["tp"])
    if par.get("activation_checkpointing") == "full":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for key in list(model.blocks):
            model.blocks[key] = checkpoint_wrapper(model.blocks[key], preserve_rng_state=False)
    if layout.fsdp > 1 or (layout.dp > 1 and layout.model_parallel):
        data = mesh["dp", "fsdp"] if layout.dp > 1 else mesh["fsdp"]
        reshard = par.get("reshard_after_forward", True)
        for block in model.blocks.values():
            fully_shard(block, mesh=data, reshard_after_forward=reshard)
        fully_shard(model, mesh=data, reshard_after_forward=reshard)
    elif not layout.model_parallel:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if layout.pp == 1:

        def step(x, y):
            lm_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step
    rank = mesh["pp"].get_local_rank()
    stage = PipelineStage(model, rank, layout.pp, ctx.device, group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=lm_loss)

    def pp_step(x, y):
        if rank == 0:
            schedule.step(x)
        elif rank == layout.pp - 1:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return pp_step


def build_distml(ctx: distml.Context):
    model = GPT(MODEL)
    model, optimizer = ctx.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))

    def step(x, y):
        ctx.train_step((x, y), loss=lm_loss)

    return step


def timed(step, batch, steps: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step(*batch)
    dist.barrier()
    return time.perf_counter() - start


def worker(ctx: distml.Context, par: dict, steps: int, repeats: int) -> dict:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(ctx.data_rank)
    batch_size = GLOBAL_BATCH // ctx.data_world
    batch = (torch.randint(0, 256, (batch_size, MODEL.seq_len), generator=g),) * 2
    torch.manual_seed(0)
    ours = build_distml(ctx)
    torch.manual_seed(0)
    plain = build_plain(ctx, par)
    for fn in (ours, plain):  # warm-up: shape inference, lazy FSDP init
        timed(fn, batch, 2)
    times: dict[str, list[float]] = {"distml": [], "plain": []}
    for r in range(repeats):
        for side in ("distml", "plain") if r % 2 == 0 else ("plain", "distml"):
            times[side].append(timed(ours if side == "distml" else plain, batch, steps))
    summary = ctx.finish()
    return {
        "times": times,
        "memory": summary.get("memory_per_rank", []),
        "bubble": summary.get("bubble"),
    }


def launch_layout(name: str, runs: Path, fn, *args) -> dict:
    """``fn(ctx, *args)`` in a world of 4 workers laid out as ``LAYOUTS[name]``."""
    mesh, par = LAYOUTS[name]
    return distml.launch(
        fn,
        *args,
        nproc=4,
        mesh=mesh,
        parallel={"microbatches": MICROBATCHES, **par},
        runs_dir=runs,
        run_name=name,
        telemetry={"progress": False},
        timeout_s=600,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per block")
    parser.add_argument("--repeats", type=int, default=3, help="blocks per side")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    args = parser.parse_args()
    results = {}
    with scratch_dir("distml-bench-mp-") as runs:
        for name in args.layouts.split(","):
            mesh, par = LAYOUTS[name]
            out = launch_layout(name, runs, worker, par, args.steps, args.repeats)
            rate = {
                side: [GLOBAL_BATCH * args.steps / t for t in ts]
                for side, ts in out["times"].items()
            }
            ratios = [a / b for a, b in zip(rate["distml"], rate["plain"], strict=True)]
            results[name] = {
                "mesh": mesh,
                "parallel": par,
                "samples_per_s": rate,
                "ratio_median": median(ratios),
                "ratios": ratios,
                "memory": out["memory"],
                "bubble": out["bubble"],
            }
            print(f"{name}: ratio {median(ratios):.3f}", flush=True)
    rows = []
    for name, res in results.items():
        mem = res["memory"]
        state = max((m["params"] + m["grads"] + m["optimizer"] for m in mem), default=0)
        acts = max((m["activations"] for m in mem), default=0)
        rows.append(
            [
                name,
                f"{median(res['samples_per_s']['plain']):,.1f}",
                f"{median(res['samples_per_s']['distml']):,.1f}",
                spread(res["samples_per_s"]["distml"]),
                f"{res['ratio_median']:.3f}",
                f"{state / 2**20:.2f}" if mem else "-",
                f"{acts / 2**20:.2f}" if mem else "-",
            ]
        )
    print_table(
        f"GPT {MODEL.layers}x{MODEL.hidden}, global batch {GLOBAL_BATCH}, 4 processes",
        [
            "layout",
            "plain samples/s",
            "distml samples/s",
            "distml min..max",
            "vs plain",
            "state MiB/rank",
            "activations MiB/rank",
        ],
        rows,
    )
    path = write_json(
        "model_parallel",
        {
            "machine": machine_info(),
            "args": vars(args),
            "model": MODEL.model_dump(),
            "results": results,
        },
    )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
