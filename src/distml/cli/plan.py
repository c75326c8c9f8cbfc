"""``distml plan``: what a layout costs, or which layouts are best, before running anything."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from distml.cli.messages import fail_usage
from distml.layout import Layout
from distml.plan.auto import Option, is_replicas, sync_options
from distml.plan.cluster_file import cluster_from_description, is_description
from distml.plan.cost_model import DEVICES, Cluster, ModelSpec, Prediction, Training, predict
from distml.plan.search import rank_layouts
from distml.plan.spec import BYTES
from distml.plan.sync import AUTO_SYNCS

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
        "assumptions": p.assumptions,
        "breakdown": p.breakdown,
    }


def _read_cluster(path: Path) -> Cluster:
    """A described cluster (a named device and its links) or one ``distml bench`` measured."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        fail_usage(f"cluster file {path}: {exc}")
    if is_description(data):
        try:
            return cluster_from_description(data)
        except ValueError as exc:
            fail_usage(f"cluster file {path}: {exc}")
    from distml.plan.bench import read_cluster_file  # imports torch: only when needed

    try:
        return read_cluster_file(path)
    except ValueError as exc:  # its message names the file
        fail_usage(str(exc))


def _sync_options(
    best: list[Prediction], model: ModelSpec, cluster: Cluster, console: Console
) -> tuple[list[Option], dict[str, float]]:
    """The fastest layout of replicas alone among ``best``, under each way to synchronise
    them, fastest to a loss first (none without such a layout); and the hooks' own seconds a
    step they were charged, by label. On CPU workers (a cluster file ``distml bench`` measured
    on them) PowerSGD's own work is measured on this machine, as ``distml run --strategy
    auto`` measures it."""
    replicas = next((p for p in best if is_replicas(p.layout)), None)
    if replicas is None:
        return [], {}
    shapes = model.weight_shapes()
    hook_s = _hook_costs(shapes, model, cluster, console)
    options = sync_options(replicas, AUTO_SYNCS, shapes, gloo=cluster.device.gloo,
                           latency_s=cluster.device.latency_s, hook_s=hook_s)  # fmt: skip
    return sorted(options, key=lambda o: o.time_to_loss_s), hook_s


def _hook_costs(
    shapes: list[tuple[int, ...]], model: ModelSpec, cluster: Cluster, console: Console
) -> dict[str, float]:
    """PowerSGD's own seconds a step on CPU workers of ``cluster`` (none elsewhere); a model
    too large to probe, or a probe that fails, leaves them out, and says so on stderr."""
    if not cluster.device.gloo:
        return {}
    from distml.plan.hook_probe import PROBE_MAX_PARAMS

    if model.n_params > PROBE_MAX_PARAMS:
        console.print(f"PowerSGD's own work is not measured for {model.n_params:.3g} "
                      f"parameters (the probe's limit: {PROBE_MAX_PARAMS:.3g})")  # fmt: skip
        return {}
    from distml.launch.elastic import worker_threads
    from distml.plan.auto import hook_costs

    threads = worker_threads(cluster.devices_per_node)
    try:
        return hook_costs(shapes, AUTO_SYNCS, cluster.device, threads)
    except RuntimeError as exc:  # the plan goes on, charging PowerSGD its bytes alone
        console.print(str(exc), highlight=False, markup=False)
        return {}


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
        Path | None,
        typer.Option(
            "--cluster",
            help="A cluster file: one `distml bench` measured, or a description of a named "
            "GPU cluster (device, devices, network, links).",
        ),
    ] = None,
    params: Count = 0.0,
    ffn_hidden: Annotated[int | None, typer.Option(min=1, help="MLP width (4h).")] = None,
    kv_heads: Annotated[int | None, typer.Option(min=1, help="Key/value heads (all).")] = None,
    gated_mlp: Annotated[bool, typer.Option(help="SwiGLU: three MLP matrices.")] = False,
    flash_attention: Annotated[bool, typer.Option(help="A fused attention kernel.")] = False,
    micro_batch: Annotated[int, typer.Option(min=1)] = 1,
    precision: Annotated[str, typer.Option(help="bf16, fp16 or fp32.")] = "bf16",
    tp: Annotated[int | None, typer.Option(min=1)] = None,
    pp: Annotated[int | None, typer.Option(min=1)] = None,
    dp: Annotated[int | None, typer.Option(min=1)] = None,
    zero: Annotated[int, typer.Option(min=0, max=3)] = 0,
    chunks: Annotated[int, typer.Option(min=1, help="Interleaved pipeline chunks a rank.")] = 1,
    recompute: Annotated[str, typer.Option(help="none, selective or full.")] = "none",
    sequence_parallel: Annotated[bool, typer.Option()] = False,
    tp_overlap: Annotated[
        bool, typer.Option(help="Tensor-parallel collectives overlapped with GEMMs.")
    ] = False,
    dp_overlap: Annotated[
        bool, typer.Option(help="Data-parallel gradients reduced during the backward pass.")
    ] = True,
    rank_by: Annotated[str, typer.Option(help="time or energy.")] = "time",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Predict memory, step time, traffic and energy of a layout (or rank all layouts)."""

    if cluster_file is not None:
        cluster = _read_cluster(cluster_file)
        devices, device = cluster.devices, cluster.device.name
    elif device not in DEVICES:
        fail_usage(f"unknown device {device!r}; choose one of: {', '.join(DEVICES)}")
    else:
        cluster = Cluster(DEVICES[device], devices)
    if recompute not in ("none", "selective", "full") or rank_by not in ("time", "energy"):
        fail_usage("--recompute is none|selective|full and --rank-by is time|energy")
    if precision not in BYTES:
        fail_usage(f"--precision is one of: {', '.join(BYTES)}")
    if kv_heads is not None and heads % kv_heads:
        fail_usage(f"--kv-heads {kv_heads} does not divide --heads {heads}")
    model = ModelSpec(
        layers,
        hidden,
        heads,
        seq,
        vocab,
        params or None,
        fused_attention=flash_attention,
        ffn_hidden=ffn_hidden,
        kv_heads=kv_heads,
        gated_mlp=gated_mlp,
    )
    training = Training(
        global_batch,
        micro_batch,
        precision,  # type: ignore[arg-type]
        recompute=recompute,  # type: ignore[arg-type]
        sequence_parallel=sequence_parallel,
        dp_overlap=dp_overlap,
        tp_overlap=tp_overlap,
    )
    try:
        if tp or pp or dp:
            tp, pp = tp or 1, pp or 1
            if heads % tp:
                fail_usage(f"--tp {tp} does not divide --heads {heads}")
            if pp > layers:
                fail_usage(f"--pp {pp} is more stages than --layers {layers}")
            schedule = "interleaved" if chunks > 1 else "1f1b"
            layout = Layout.sharded(
                dp or max(1, devices // (tp * pp)),
                zero,
                tp=tp,
                pp=pp,
                schedule=schedule,
                chunks=chunks,
            )
            best, rejected = [predict(model, cluster, training, layout)], []
        else:
            best, rejected = rank_layouts(model, cluster, training, rank_by)
    except ValueError as exc:
        fail_usage(str(exc))
    syncs, hook_s = _sync_options(best, model, cluster, Console(stderr=True))
    if as_json:
        print(
            json.dumps(
                {
                    "layouts": [_row(p) for p in best],
                    "rejected": [_row(p) for p in rejected],
                    "syncs": [
                        {
                            "sync": o.sync.label,
                            "steps_factor": o.steps_factor,
                            "hook_s": hook_s.get(o.sync.label, 0.0),
                            **_row(o.prediction),
                        }
                        for o in syncs
                    ],
                },
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
            f"{lay.pp}" + (f" x{lay.chunks}" if lay.chunks > 1 else ""),
            str(lay.zero),
            f"{p.memory_bytes['total'] / 1e9:.1f}",
            f"{p.step_time_s:.3f}",
            f"{p.tokens_per_s:,.0f}",
            f"{p.mfu:.2f}",
            "; ".join(p.notes),
        )
    console = Console()
    console.print(table)
    if best and best[0].assumptions:
        console.print("assumed (the first row's):")
        for key, text in best[0].assumptions.items():
            console.print(f"  {key}: {text}", highlight=False)
    if rejected:
        console.print(f"{len(rejected)} layouts do not fit in {device} memory")
    if syncs:
        table = Table(title=f"synchronising the replicas of {syncs[0].layout}, fastest to a loss")
        columns = ["sync", "step s", "exposed comm s", "steps x DDP", "time to a loss x DDP"]
        for col in columns + ["hook s"] * bool(hook_s):
            table.add_column(col)
        if hook_s:
            table.caption = "hook s: the seconds a step PowerSGD's own work took on this machine"
        ddp = next(o for o in syncs if o.sync.name == "ddp").time_to_loss_s
        for o in syncs:
            p = o.prediction
            own = [f"{hook_s[o.sync.label]:.4f}" if o.sync.label in hook_s else ""]
            table.add_row(
                o.sync.label,
                f"{p.step_time_s:.3f}",
                f"{p.comm_exposed_s:.3f}",
                f"{o.steps_factor:g}",
                f"{o.time_to_loss_s / ddp:.2f}",
                *own * bool(hook_s),
            )
        console.print(table)


def bench(
    nproc: Annotated[
        int, typer.Option(min=1, help="Worker processes on this node (a world of >= 2).")
    ] = 2,
    nnodes: Annotated[
        int, typer.Option(min=1, help="Nodes: each runs this command (links apart).")
    ] = 1,
    rdzv_endpoint: Annotated[
        str | None, typer.Option(help="HOST:PORT of the rendezvous, for more than one node.")
    ] = None,
    node_rank: Annotated[int | None, typer.Option(help="Fixed rank of this node.")] = None,
    rdzv_id: Annotated[str | None, typer.Option(help="The same on every node.")] = None,
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
    auto` read; with --config, also profile that model's step for the planner. With --nnodes,
    run it on every node: the links inside a node and between nodes are measured apart, and
    the node of rank 0 writes the file."""
    from distml.config import ConfigError, GPTConfig, load_config
    from distml.launch.api import launch
    from distml.plan.bench import measure, write_cluster_file

    if nproc * nnodes < 2:
        fail_usage("the network needs a world of at least 2 workers: raise --nproc or --nnodes")
    gpt, microbatches = None, 1
    if config is not None:
        try:
            run = load_config(config)
        except ConfigError as exc:
            fail_usage(str(exc))
        gpt, microbatches = run.model or GPTConfig(), run.parallel.microbatches
    try:
        result = launch(
            lambda ctx: measure(
                gpt=gpt, global_batch=global_batch, microbatches=microbatches, passes=passes
            ),
            nproc=nproc,
            min_nodes=nnodes,
            max_nodes=nnodes,
            rdzv_endpoint=rdzv_endpoint,
            node_rank=node_rank,
            rdzv_id=rdzv_id,
            runs_dir=Path("runs"),
            run_name=f"bench-{nnodes}x{nproc}",
            telemetry={"progress": False},
        )
    except ConfigError as exc:  # the nodes' settings do not fit together
        fail_usage(str(exc))
    if result is None:  # another node holds rank 0
        Console().print("measured; the node of rank 0 writes the cluster file")
        return
    write_cluster_file(result, out)
    dev = result["device"]
    Console().print(
        f"matmul {dev['peak_flops'] / 1e9:.1f} GFLOP/s per worker, all-reduce bus "
        f"{dev['intra_bw'] / 1e9:.2f} GB/s, point-to-point {result['measured']['p2p_bw'] / 1e9:.2f}"
        f" GB/s, latency {dev['latency_s'] * 1e6:.0f} us -> {out}"
    )
    if nnodes > 1:

        def by_size(key: str) -> str:
            return ", ".join(f"{bw / 1e6:.1f} at {size / 2**20:g} MiB" for size, bw in dev[key])

        Console().print(
            f"{nnodes} nodes x {result['devices_per_node']}: between nodes "
            f"{dev['inter_bw'] / 1e6:.1f} MB/s, inside a node {dev['intra_bw'] / 1e6:.1f} MB/s; "
            f"between nodes all-gathers {by_size('inter_allgather_bw')} a shard, both ways at "
            f"once {by_size('inter_exchange_bw')} a message (MB/s)"
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
