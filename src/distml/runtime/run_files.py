"""Writing ``runs/<name>/``: metrics.jsonl, summary.json, report.html and the exported model.

Every rank takes part in the gather (a collective); rank 0 writes.
"""

from __future__ import annotations

import json
import statistics
from typing import Any

from distml.comm.collectives import all_gather_json
from distml.telemetry.console import print_summary
from distml.telemetry.run_record import RunRecord
from distml.telemetry.summary import measured_bubble, memory_per_rank, summarize
from distml.train.checkpoint import (
    export_safetensors,
    export_state,
    norm_of,
    param_norm,
)


def write_run_files(run: RunRecord, eval_metrics: dict[str, float]) -> dict[str, Any]:
    records = [r.to_json() for r in run.recorder.records]
    per_rank = all_gather_json(records, run.device)
    summary: dict[str, Any] = {
        "run_name": run.config.run_name,
        "world_size": run.world_size,
        "strategy": run.config.strategy.model_dump(),
        "mesh": run.mesh,
        "attempt": run.attempt,
        "wall_s": run.wall_s,
        **summarize(per_rank, run.config.telemetry.straggler_factor),
        "eval": eval_metrics,
        "energy_source": run.recorder.energy.source,
        "param_norm": None,
        "export": None,
    }
    if run.model_parallel:
        summary.update(layout_summary(run, per_rank))
    elif run.module is not None:
        summary["param_norm"] = param_norm(run.module)
        if memory := memory_per_rank(per_rank):  # none for a parameter-server worker
            summary["memory_per_rank"] = memory
    if run.config.plan is not None:
        summary["plan"] = plan_against_run(run.config.plan, per_rank, summary)
    if run.rank != 0:
        return summary
    run_dir = run.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    export = run_dir / "model.safetensors"
    if run.full_state is not None:
        state, params = run.full_state
        summary["param_norm"] = norm_of(state[n] for n in sorted(params))
        summary["export"] = str(export_state(state, export))
    elif run.module is not None:
        summary["export"] = str(export_safetensors(run.module, export))
    with open(run_dir / "metrics.jsonl", "w") as f:
        for records in per_rank:
            for rec in records:
                f.write(json.dumps(rec) + "\n")
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    from distml.telemetry.report import write_report  # matplotlib: rank 0 only, at the end

    summary["report"] = str(write_report(run_dir, per_rank, summary))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if run.config.telemetry.progress:
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


def layout_summary(run: RunRecord, per_rank: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """What a model-parallel run adds to its summary: the layout, memory per rank, the bubble."""
    par = run.config.parallel
    pp = run.mesh["pp"]
    out: dict[str, Any] = {
        "layout": {
            **run.mesh,
            "activation_checkpointing": par.activation_checkpointing,
            "sequence_parallel": par.sequence_parallel,
            "reshard_after_forward": par.reshard_after_forward,
        },
        "memory_per_rank": memory_per_rank(per_rank),
    }
    if pp > 1:
        from distml.parallel.pipeline import pipeline_bubble

        out["layout"].update(
            schedule=par.schedule, microbatches=par.microbatches, stages_per_rank=par.virtual_stages
        )
        out["bubble"] = {
            **(measured_bubble(per_rank) or {"measured": None}),
            "formula": pipeline_bubble(pp, par.microbatches, par.virtual_stages),
        }
    return out
