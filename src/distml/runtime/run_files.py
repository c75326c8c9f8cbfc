"""Writing ``runs/<name>/``: metrics.jsonl, summary.json, report.html and the exported model.

Every rank takes part in the gather (a collective); rank 0 writes.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from distml.runtime.collectives import all_gather_json
from distml.telemetry.summary import format_bytes, measured_bubble, memory_per_rank, summarize
from distml.train.checkpoint import (
    export_safetensors,
    export_state,
    norm_of,
    param_norm,
)

if TYPE_CHECKING:
    from distml.runtime.context import Context


def write_run_files(ctx: Context, eval_metrics: dict[str, float]) -> dict[str, Any]:
    records = [r.to_json() for r in ctx.recorder.records]
    per_rank = all_gather_json(records, ctx.device)
    summary: dict[str, Any] = {
        "run_name": ctx.config.run_name,
        "world_size": ctx.world_size,
        "strategy": ctx.config.strategy.model_dump(),
        "mesh": ctx.dims.as_dict() if ctx.model_parallel else {"dp": ctx.world_size},
        "attempt": ctx.attempt,
        "wall_s": time.perf_counter() - ctx._started,
        **summarize(per_rank, ctx.config.telemetry.straggler_factor),
        "eval": eval_metrics,
        "energy_source": ctx.recorder.energy.source,
        "param_norm": None,
        "export": None,
    }
    full = None
    if ctx.model_parallel:
        summary.update(layout_summary(ctx, per_rank))
        full = ctx.full_state_dict()
    elif ctx.model is not None:
        summary["param_norm"] = param_norm(ctx._module())
        if memory := memory_per_rank(per_rank):  # none for a parameter-server worker
            summary["memory_per_rank"] = memory
    if ctx.config.plan is not None:
        summary["plan"] = plan_against_run(ctx.config.plan, per_rank, summary)
    if ctx.rank != 0:
        return summary
    run_dir = ctx.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    export = run_dir / "model.safetensors"
    if full is not None:
        state, params = full
        summary["param_norm"] = norm_of(state[n] for n in sorted(params))
        summary["export"] = str(export_state(state, export))
    elif ctx.model is not None:
        summary["export"] = str(export_safetensors(ctx._module(), export))
    with open(run_dir / "metrics.jsonl", "w") as f:
        for records in per_rank:
            for rec in records:
                f.write(json.dumps(rec) + "\n")
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    from distml.telemetry.report import write_report  # matplotlib: rank 0 only, at the end

    summary["report"] = str(write_report(run_dir, per_rank, summary))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if ctx.config.telemetry.progress:
        print_summary(summary)
    return summary


def plan_against_run(
    plan: dict[str, Any], per_rank: list[list[dict[str, Any]]], summary: dict[str, Any]
) -> dict[str, Any]:
    """The planner's prediction beside the run's measurement: the median step (the slowest
    rank's, the first two steps left out as warm-up) and the largest rank's memory."""
    steps = min((len(records) for records in per_rank), default=0)
    slowest = [max(records[t]["step_s"] for records in per_rank) for t in range(steps)]
    timed = slowest[2:] or slowest
    memory = summary.get("memory_per_rank") or []
    measured = {
        "step_time_s": statistics.median(timed) if timed else None,
        "memory_bytes": max((r["total"] for r in memory), default=None),
        "activation_bytes": max((r["activations"] for r in memory), default=None),
    }
    return {**plan, "measured": measured}


def layout_summary(ctx: Context, per_rank: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """What a model-parallel run adds to its summary: the layout, memory per rank, the bubble."""
    par = ctx.config.parallel
    dims = ctx.dims
    out: dict[str, Any] = {
        "layout": {
            **dims.as_dict(),
            "activation_checkpointing": par.activation_checkpointing,
            "sequence_parallel": par.sequence_parallel,
            "reshard_after_forward": par.reshard_after_forward,
        },
        "memory_per_rank": memory_per_rank(per_rank),
    }
    if dims.pp > 1:
        from distml.parallel.pipeline import pipeline_bubble

        out["layout"].update(
            schedule=par.schedule, microbatches=par.microbatches, stages_per_rank=par.virtual_stages
        )
        out["bubble"] = {
            **(measured_bubble(per_rank) or {"measured": None}),
            "formula": pipeline_bubble(dims.pp, par.microbatches, par.virtual_stages),
        }
    return out


def print_summary(summary: dict[str, Any]) -> None:
    table = Table(title=f"distml run {summary['run_name']}", show_header=False)
    table.add_row("world size", str(summary["world_size"]))
    table.add_row("steps", str(summary["steps"]))
    if summary["final_loss"] is not None:
        table.add_row("final loss", f"{summary['final_loss']:.4f}")
    for name, value in summary["eval"].items():
        table.add_row(f"eval {name}", f"{value:.4f}" if isinstance(value, float) else str(value))
    table.add_row("samples/s", f"{summary['samples_per_s']:,.0f}")
    table.add_row(
        "compute / comm / wait (s)",
        "{:.2f} / {:.2f} / {:.2f}".format(
            summary["compute_s"], summary["comm_s"], summary["sync_wait_s"]
        ),
    )
    for name, n in summary["comm_bytes"].items():
        table.add_row(f"{name} payload per rank", format_bytes(n))
    if "layout" in summary:
        dims = ("pp", "dp", "fsdp", "tp")
        table.add_row("layout", " x ".join(f"{d}={summary['layout'][d]}" for d in dims))
        memory = summary["memory_per_rank"]
        if memory:
            table.add_row(
                "state / activations (max rank)",
                "{} / {}".format(
                    format_bytes(max(r["params"] + r["grads"] + r["optimizer"] for r in memory)),
                    format_bytes(max(r["activations"] for r in memory)),
                ),
            )
        bubble = summary.get("bubble")
        if bubble and bubble.get("measured") is not None:
            table.add_row(
                "pipeline bubble (measured / formula)",
                f"{bubble['measured']:.3f} / {bubble['formula']:.3f}",
            )
    table.add_row("energy", f"{summary['energy_j']:.1f} J ({summary['energy_source']})")
    stragglers = ", ".join(f"rank {s['rank']} ({s['ratio']:.2f}x)" for s in summary["stragglers"])
    table.add_row("stragglers", stragglers or "none")
    table.add_row("report", summary.get("report", ""))
    Console(stderr=True).print(table)
