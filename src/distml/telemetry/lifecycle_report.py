"""The report of ``distml demo``'s lifecycle: each stage, what it did, what it took and cost, and
the two runs' own reports beside it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from distml.telemetry.report import _esc, _table, write_html
from distml.telemetry.units import format_figure, format_seconds

_STAGE_FIGURES = {
    "preprocess": ("rows", "shards", "workers"),
    "train": ("steps", "comm_bytes", "sync_wait_s", "energy_j"),
    "fine-tune": ("steps", "comm_bytes", "sync_wait_s", "energy_j"),
    "validate": ("base_accuracy", "base_accuracy_mirrored", "finetuned_accuracy_mirrored"),
    "batch inference": ("samples", "workers", "accuracy"),
    "serve": (
        "replicas",
        "requests",
        "latency_ms_p50",
        "served_per_replica",
        "answers_match_batch_inference",
    ),
}


def write_lifecycle_report(folder: Path, summary: dict[str, Any]) -> Path:
    """Write ``folder/report.html`` from the lifecycle's ``summary``; returns its path."""
    stages = summary["stages"]
    rows = [
        [
            name,
            format_seconds(stage["seconds"]),
            ", ".join(f"{k}={format_figure(k, stage.get(k))}" for k in _STAGE_FIGURES[name]),
        ]
        for name, stage in stages.items()
    ]
    runs = "".join(
        f'<li><a href="{_esc(Path(path).name)}/report.html">{_esc(name)}</a></li>'
        for name, path in summary["runs"].items()
    )
    parts = [
        f"<h1>Lifecycle {_esc(summary['run_name'])}</h1>",
        f"<p>{summary['workers']} worker processes; "
        f"{format_seconds(summary['seconds'])} in all.</p>",
        "<h2>Stages</h2>",
        _table(["stage", "time", "figures"], rows),
        "<h2>Runs</h2>",
        f"<p>The training and fine-tuning runs' own reports:</p><ul>{runs}</ul>",
    ]
    return write_html(folder / "report.html", f"lifecycle {summary['run_name']}", parts)
