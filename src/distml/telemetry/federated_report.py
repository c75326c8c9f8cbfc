"""The report of a federated run: accuracy and loss against rounds, what each round cost (bytes,
the wait for the slowest client, energy), and the privacy spent — one self-contained HTML file
like a training run's report — and the same rounds as TensorBoard event files in ``tb/``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from distml.telemetry.metrics_stream import round_scalars, write_events
from distml.telemetry.report import _figure, _png, _table, write_html
from distml.telemetry.units import axis_scale, format_figure

_SUMMARY = (
    "strategy", "clients", "partition", "rounds", "accuracy", "loss", "epsilon", "failed_rounds",
    "late_updates", "bytes_down", "bytes_up", "straggler_wait_s", "energy_j", "energy_source",
    "wall_s",
)  # fmt: skip
_ROUND_COLUMNS = (
    "round", "status", "selected", "participants", "accuracy", "loss", "epsilon", "bytes_down",
    "bytes_up", "straggler_wait_s", "energy_j", "duration_s",
)  # fmt: skip


def _series(history: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    rows = [h for h in history if h.get("status") == "completed" and h.get(key) is not None]
    return [h["round"] for h in rows], [float(h[key]) for h in rows]


def write_federated_report(out_dir: Path, history: list[dict[str, Any]], summary: dict[str, Any]):
    """Write out_dir/'report.html' (and the rounds' figures to out_dir/'tb', where tensorboard
    is installed); returns the report's path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = []
    for key, title, label in (
        ("accuracy", "Validation accuracy of the global model", "accuracy"),
        ("loss", "Validation loss of the global model", "loss"),
        ("epsilon", "Privacy spent (epsilon)", "epsilon"),
    ):
        rounds, values = _series(history, key)
        if rounds:
            fig, ax = _figure(label, title, "round", key)
            ax.plot(rounds, values, marker=".")
            plots.append(_png(fig))
    rounds, down = _series(history, "bytes_down")
    _, up = _series(history, "bytes_up")
    if rounds:
        divisor, unit = axis_scale([d + u for d, u in zip(down, up, strict=True)], "bytes")
        fig, ax = _figure("bytes", "Bytes on the network per round", "round", f"traffic ({unit})")
        down, up = [d / divisor for d in down], [u / divisor for u in up]
        ax.bar(rounds, down, label="to clients")
        ax.bar(rounds, up, bottom=down, label="from clients")
        ax.legend()
        plots.append(_png(fig))
    parts = [
        "<h1>Federated run</h1>",
        "<h2>Summary</h2>",
        _table(
            ["figure", "value"],
            [[k, format_figure(k, summary[k])] for k in _SUMMARY if k in summary],
        ),  # fmt: skip
        "<h2>Plots</h2>",
        *(plots or ["<p>No round completed.</p>"]),
        "<h2>Rounds</h2>",
        _table(
            list(_ROUND_COLUMNS),
            [[format_figure(c, h.get(c)) for c in _ROUND_COLUMNS] for h in history],
        ),
    ]
    write_events(out_dir / "tb", round_scalars(history))
    return write_html(out_dir / "report.html", "federated run", parts)
