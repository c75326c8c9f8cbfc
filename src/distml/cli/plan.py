"""``distml plan``: what a layout costs, or which layouts are best, before running anything."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from distml.cli.messages import fail_usage
from distml.layout import Layout
from distml.plan.cost_model import DEVICES, Cluster, ModelSpec, Prediction, Training, predict
from distml.plan.search import rank_layouts

Count = Annotated[float, typer.Option(help="Accepts scientific notation, e.g. 7.5e9.")]


def _row(p: Prediction) -> dict:
    return {
        "layout": p.layout.record(),
        "memory_bytes": p.memory_bytes,
        "step_time_s": p.step_time_s,
        "tokens_per_s": p.tokens_per_s,
        "mfu": p.mfu,
        "comm_bytes": p.comm_bytes,
        "comm_s": p.comm_s,
        "comm_exposed_s": p.comm_exposed_s,
        "bubble_fraction": p.bubble_fraction,
        "energy_j": p.energy_j,
        "notes": p.notes,
    }


def plan(
    layers: Annotated[int, typer.Option(min=1)],
    hidden: Annotated[int, typer.Option(min=1)],
    heads: Annotated[int, typer.Option(min=1)],
    seq: Annotated[int, typer.Option(min=1)],
    vocab: Annotated[int, typer.Option(min=1)],
    global_batch: Annotated[int, typer.Option(min=1)],
    devices: Annotated[int, typer.Option(min=1)] = 1,
    device: Annotated[str, typer.Option(help=f"One of: {', '.join(DEVICES)}.")] = "a100",
    cluster_file: Annotated[
        Path | None, typer.Option("--cluster", help="A cluster file from `distml bench`.")
    ] = None,
    params: Count = 0.0,
    micro_batch: Annotated[int, typer.Option(min=1)] = 1,
    tp: Annotated[int | None, typer.Option(min=1)] = None,
    pp: Annotated[int | None, typer.Option(min=1)] = None,
    dp: Annotated[int | None, typer.Option(min=1)] = None,
    zero: Annotated[int, typer.Option(min=0, max=3)] = 0,
    recompute: Annotated[str, typer.Option(help="none, selective or full.")] = "none",
    rank_by: Annotated[str, typer.Option(help="time or energy.")] = "time",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Predict memory, step time, traffic and energy of a layout (or rank all layouts)."""

    if cluster_file is not None:
        from distml.plan.bench import read_cluster_file  # imports torch: only when needed

        try:
            cluster = read_cluster_file(cluster_file)
        except ValueError as exc:
            fail_usage(str(exc))
        devices, device = cluster.devices, cluster.device.name
    elif device not in DEVICES:
        fail_usage(f"unknown device {device!r}; choose one of: {', '.join(DEVICES)}")
    else:
        cluster = Cluster(DEVICES[device], devices)
    if recompute not in ("none", "selective", "full") or rank_by not in ("time", "energy"):
        fail_usage("--recompute is none|selective|full and --rank-by is time|energy")
    model = ModelSpec(layers, hidden, heads, seq, vocab, params or None)
    training = Training(global_batch, micro_batch, recompute=recompute)  # type: ignore[arg-type]
    try:
        if tp or pp or dp:
            tp, pp = tp or 1, pp or 1
            layout = Layout.sharded(dp or max(1, devices // (tp * pp)), zero, tp=tp, pp=pp)
            if heads % tp:
                fail_usage(f"--tp {tp} does not divide --heads {heads}")
            if pp > layers:
                fail_usage(f"--pp {pp} is more stages than --layers {layers}")
            best, rejected = [predict(model, cluster, training, layout)], []
        else:
            best, rejected = rank_layouts(model, cluster, training, rank_by)
    except ValueError as exc:
        fail_usage(str(exc))
    if as_json:
        print(
            json.dumps(
                {"layouts": [_row(p) for p in best], "rejected": [_row(p) for p in rejected]},
                indent=2,
            )
        )
        return
    table = Table(title=f"{model.n_params:.3g} parameters on {devices} x {device}")
    for col in ("dp", "tp", "pp", "zero", "memory GB", "step s", "tokens/s", "MFU", "note"):
        table.add_column(col)
    for p in best[:10]:
        lay = p.layout
        table.add_row(
            str(lay.data_parallel),
            str(lay.tp),
            str(lay.pp),
            str(lay.zero),
            f"{p.memory_bytes['total'] / 1e9:.1f}",
            f"{p.step_time_s:.3f}",
            f"{p.tokens_per_s:,.0f}",
            f"{p.mfu:.2f}",
            "; ".join(p.notes),
        )
    Console().print(table)
    if rejected:
        Console().print(f"{len(rejected)} layouts do not fit in {device} memory")


def bench(
    nproc: Annotated[int, typer.Option(min=2, help="Worker processes (>= 2 for the network).")] = 2,
    out: Annotated[Path, typer.Option(help="Where to write the cluster file.")] = Path(
        "cluster.toml"
    ),
    config: Annotated[
        Path | None,
        typer.Option(
            help="A run config (TOML) whose GPT ([model]) and micro-batches ([parallel]) to "
            "calibrate the planner for: its step's pieces are profiled under every layout."
        ),
    ] = None,
    global_batch: Annotated[
        int, typer.Option(min=1, help="The global batch of the calibrated runs.")
    ] = 16,
    passes: Annotated[
        int,
        typer.Option(
            min=1,
            help="With --config: profile every piece this many times and keep the medians "
            "(3 on a machine shared with other work).",
        ),
    ] = 1,
) -> None:
    """Measure this machine (matmul FLOP/s, collectives, point-to-point bandwidth, latency,
    memory) and write a cluster file that `distml plan --cluster` and `distml run --strategy
    auto` read; with --config, also profile that model's step for the planner."""
    from distml.config import ConfigError, GPTConfig, load_config
    from distml.launch.api import launch
    from distml.plan.bench import measure, write_cluster_file

    gpt, microbatches = None, 1
    if config is not None:
        try:
            run = load_config(config)
        except ConfigError as exc:
            fail_usage(str(exc))
        gpt, microbatches = run.model or GPTConfig(), run.parallel.microbatches
    result = launch(
        lambda ctx: measure(
            gpt=gpt, global_batch=global_batch, microbatches=microbatches, passes=passes
        ),
        nproc=nproc,
        runs_dir=Path("runs"),
        run_name=f"bench-{nproc}",
        telemetry={"progress": False},
    )
    write_cluster_file(result, out)
    dev = result["device"]
    Console().print(
        f"matmul {dev['peak_flops'] / 1e9:.1f} GFLOP/s per worker, all-reduce bus "
        f"{dev['intra_bw'] / 1e9:.2f} GB/s, point-to-point {result['measured']['p2p_bw'] / 1e9:.2f}"
        f" GB/s, latency {dev['latency_s'] * 1e6:.0f} us -> {out}"
    )
    if gpt is not None:
        cal = result["calibration"]
        Console().print(
            f"calibrated for the GPT of {config}: {len(cal['blocks'])} block shapes and "
            f"{len(cal['sharded_stages'])} FSDP stages profiled"
        )


def simulate(
    stages: Annotated[int, typer.Option(min=1, help="Pipeline stages.")] = 4,
    microbatches: Annotated[int, typer.Option(min=1)] = 8,
    schedule: Annotated[str, typer.Option(help="gpipe or 1f1b.")] = "1f1b",
    gantt: Annotated[Path, typer.Option(help="Where to draw the step's timeline.")] = Path(
        "pipeline.png"
    ),
    workers: Annotated[int, typer.Option(min=1, help="Workers for the straggler study.")] = 64,
    backup: Annotated[int, typer.Option(min=0, help="Backup workers.")] = 2,
    mtbf_s: Annotated[float, typer.Option(min=1, help="Mean time between failures, job.")] = 3600,
    checkpoint_s: Annotated[float, typer.Option(min=0, help="Seconds to write a checkpoint.")] = 60,
    restart_s: Annotated[float, typer.Option(min=0, help="Seconds to restart.")] = 30,
) -> None:
    """Simulate a pipeline step (Gantt chart), stragglers, and failures with checkpoints."""
    from distml.plan.simulator import (
        bubble_of,
        draw_gantt,
        simulate_failures,
        simulate_pipeline,
        simulate_stragglers,
        young_daly_interval,
    )

    if schedule not in ("gpipe", "1f1b"):
        fail_usage(f"unknown schedule {schedule!r}: gpipe or 1f1b")
    console = Console()
    tasks = simulate_pipeline(stages, microbatches, schedule=schedule)
    draw_gantt(tasks, stages, gantt)
    formula = (stages - 1) / (microbatches + stages - 1)
    console.print(
        f"pipeline {schedule}: bubble {bubble_of(tasks, stages):.1%} "
        f"(formula (p-1)/(m+p-1) = {formula:.1%}); timeline: {gantt}"
    )
    rates = simulate_stragglers(workers, steps=200, backup=backup)
    console.print(
        "stragglers, worker-steps per unit time: "
        + ", ".join(f"{k} {v:.1f}" for k, v in rates.items())
    )
    optimum = young_daly_interval(checkpoint_s, mtbf_s)
    table = Table(title=f"goodput vs checkpoint interval (Young/Daly optimum {optimum:.0f} s)")
    table.add_column("interval s")
    table.add_column("goodput")
    for factor in (0.25, 0.5, 1.0, 2.0, 4.0):
        interval = optimum * factor
        runs = [
            simulate_failures(100 * mtbf_s, interval, checkpoint_s, restart_s, mtbf_s, seed=s)
            for s in range(10)
        ]
        table.add_row(f"{interval:.0f}", f"{sum(runs) / len(runs):.3f}")
    console.print(table)
