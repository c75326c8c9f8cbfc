"""Writing ``runs/<name>/``: metrics.jsonl, tb/, summary.json, report.html and the exported model.

Every rank takes part in the gather (a collective); rank 0 writes. A rank that shares no process
group (a parameter-server worker) writes its own records to ``workers/`` instead, and the job
that started it (:mod:`distml.jobs.ps`) writes the run's files from them.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from distml.comm.collectives import all_gather_json
from distml.telemetry.console import print_summary
from distml.telemetry.metrics_stream import write_metrics
from distml.telemetry.mlflow_log import target_for
from distml.telemetry.run_record import RunRecord
from distml.telemetry.summary import measured_bubble, memory_per_rank, summarize
from distml.train.checkpoint import (
    export_safetensors,
    export_state,
    norm_of,
    param_norm,
)


def write_run_files(run: RunRecord, eval_metrics: dict[str, float]) -> dict[str, Any]:
    if not run.shares_process_group:
        return write_worker_files(run, eval_metrics)
    records = [r.to_json() for r in run.recorder.records]
    per_rank = all_gather_json(records, run.device)
    sharers = run.mesh.get("tp", 1) * run.mesh.get("pp", 1)  # ranks that see the same batch
    summary: dict[str, Any] = {
        "run_name": run.config.run_name,
        "world_size": run.world_size,
        "strategy": run.config.strategy.model_dump(),
        "mesh": run.mesh,
        "attempt": run.attempt,
        "wall_s": run.wall_s,
        **summarize(per_rank, run.config.telemetry.straggler_factor, ranks_per_batch=sharers),
        "eval": eval_metrics,
        "energy_source": run.recorder.energy.source,
        "param_norm": None,
        "export": None,
        **run.summary,
    }
    if run.module is not None:
        summary["param_norm"] = param_norm(run.module)
    if memory := memory_per_rank(per_rank):
        summary["memory_per_rank"] = memory
    if bubble := measured_bubble(per_rank):  # the idle share of a pipeline's steps
        summary["bubble"] = {**summary.get("bubble", {}), **bubble}
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
    mlflow = target_for(run.config, run.attempt)
    write_metrics(run_dir, per_rank, eval_metrics, sharers, mlflow)  # jsonl, tb/, MLflow
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


def worker_file(run_dir: Path, rank: int, attempt: int) -> Path:
    return run_dir / "workers" / f"rank-{rank}-attempt-{attempt}.json"


def write_worker_files(run: RunRecord, eval_metrics: dict[str, float]) -> dict[str, Any]:
    """A worker's part of the run files: its step records and its evaluation."""
    records = [r.to_json() for r in run.recorder.records]
    path = worker_file(run.run_dir, run.rank, run.attempt)
    path.parent.mkdir(parents=True, exist_ok=True)
    out = {
        "rank": run.rank,
        "attempt": run.attempt,
        "records": records,
        "eval": eval_metrics,
        "energy_source": run.recorder.energy.source,
    }
    path.write_text(json.dumps(out))
    return {"rank": run.rank, "steps": run.steps, "eval": eval_metrics}
