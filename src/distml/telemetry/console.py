"""The run's summary as a table on stderr, at the end of a run."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from distml.telemetry.units import format_bytes, format_energy, format_rate, format_seconds


def print_summary(summary: dict[str, Any]) -> None:
    table = Table(title=f"distml run {summary['run_name']}", show_header=False)
    table.add_row("world size", str(summary["world_size"]))
    table.add_row("steps", str(summary["steps"]))
    if summary["final_loss"] is not None:
        table.add_row("final loss", f"{summary['final_loss']:.4f}")
    for name, value in summary["eval"].items():
        table.add_row(f"eval {name}", f"{value:.4f}" if isinstance(value, float) else str(value))
    table.add_row("throughput", format_rate(summary["samples_per_s"]))
    table.add_row(
        "compute / comm / wait",
        " / ".join(format_seconds(summary[k]) for k in ("compute_s", "comm_s", "sync_wait_s")),
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
    table.add_row("energy", f"{format_energy(summary['energy_j'])} ({summary['energy_source']})")
    stragglers = ", ".join(f"rank {s['rank']} ({s['ratio']:.2f}x)" for s in summary["stragglers"])
    table.add_row("stragglers", stragglers or "none")
    table.add_row("report", summary.get("report", ""))
    Console(stderr=True).print(table)
