"""A self-contained HTML report of one training run: plots as base64 PNGs, inline CSS, no links.

Figures read in their units (27.0 MB, 850 ms, 10.9 k samples/s: :mod:`distml.telemetry.units`);
the exact numbers are in ``summary.json`` and ``metrics.jsonl``.

Figures are drawn on ``matplotlib.figure.Figure`` objects directly (Agg canvas, no pyplot), so
writing a report touches no global plotting state and needs no display.
"""

from __future__ import annotations

import base64
import html
import io
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distml.telemetry.units import (
    axis_scale,
    format_bytes,
    format_figure,
    format_rate,
    format_seconds,
)

if TYPE_CHECKING:  # matplotlib is slow to import: only a process that draws pays for it
    from matplotlib.figure import Figure

Records = list[list[dict[str, Any]]]

_CSS = """
body { font-family: sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: right; }
th { background: #f0f0f0; } td:first-child, th:first-child { text-align: left; }
img { max-width: 100%; display: block; margin: 1em 0; }
"""


def _esc(value: Any) -> str:
    return html.escape(str(value))


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}={_fmt(v)}" for k, v in value.items()) or "-"
    return str(value)


def _by_step(
    per_rank: Records, key: str, reduce: Callable[[list[float]], float]
) -> tuple[list[int], list[float]]:
    """Steps present in any rank, and ``reduce`` of ``key`` over the ranks at each step."""
    values: dict[int, list[float]] = defaultdict(list)
    for records in per_rank:
        for rec in records:
            if rec.get(key) is not None:
                values[int(rec["step"])].append(float(rec[key]))
    steps = sorted(values)
    return steps, [reduce(values[s]) for s in steps]


def _png(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    return f'<img src="data:image/png;base64,{data}" alt="{_esc(fig.get_label())}">'


def _figure(label: str, title: str, xlabel: str, ylabel: str) -> tuple[Figure, Any]:
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(7, 3.5))
    fig.set_label(label)
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps, rounds, ranks: no 1.5
    ax.grid(alpha=0.3)
    return fig, ax


def _plots(per_rank: Records, summary: dict[str, Any]) -> list[str]:
    """The five plots as ``<img>`` tags; none when no rank recorded a step."""
    if not any(per_rank):
        return []
    imgs = []

    fig, ax = _figure("loss", "Loss", "step", "loss")
    steps, mean = _by_step(per_rank, "loss", lambda v: sum(v) / len(v))
    ax.plot(steps, mean, label="mean over ranks")
    steps0, loss0 = _by_step(per_rank[:1], "loss", lambda v: v[0])
    ax.plot(steps0, loss0, label="rank 0", linestyle="--", alpha=0.7)
    ax.legend()
    imgs.append(_png(fig))

    rates: dict[int, float] = defaultdict(float)
    for records in per_rank:
        for rec in records:
            if rec.get("step_s"):
                rates[int(rec["step"])] += rec.get("samples", 0) / rec["step_s"]
    divisor, unit = axis_scale(list(rates.values()), "samples/s")
    fig, ax = _figure("throughput", "Throughput (all ranks)", "step", f"throughput ({unit})")
    ax.plot(sorted(rates), [rates[s] / divisor for s in sorted(rates)])
    imgs.append(_png(fig))

    divisor, unit = axis_scale([r["step_s"] for records in per_rank for r in records], "s")
    fig, ax = _figure("step_time", "Step time per rank", "step", f"step time ({unit})")
    for rank, records in enumerate(per_rank):
        if records:
            times = [r["step_s"] / divisor for r in records]
            ax.plot([r["step"] for r in records], times, label=f"{rank}")
    ax.legend(title="rank", fontsize="small")
    imgs.append(_png(fig))

    ranks = list(range(len(per_rank)))
    split = {
        name: [sum(r.get(key, 0.0) for r in records) for records in per_rank]
        for key, name in (
            ("compute_s", "compute"),
            ("comm_s", "communication"),
            ("sync_wait_s", "sync wait"),
        )
    }
    divisor, unit = axis_scale([sum(t) for t in zip(*split.values(), strict=True)], "s")
    fig, ax = _figure("time_split", "Time split per rank (totals)", "rank", f"time ({unit})")
    bottom = [0.0] * len(ranks)
    for name, seconds in split.items():
        totals = [t / divisor for t in seconds]
        ax.bar(ranks, totals, bottom=bottom, label=name)
        bottom = [b + t for b, t in zip(bottom, totals, strict=True)]
    ax.set_xticks(ranks)
    ax.legend()
    imgs.append(_png(fig))

    source = summary.get("energy_source", "unknown")
    steps, energy = _by_step(per_rank, "energy_j", sum)
    divisor, unit = axis_scale(energy, "J")
    title = f"Energy per step, all ranks (source: {source})"
    fig, ax = _figure("energy", title, "step", f"energy ({unit})")
    ax.plot(steps, [e / divisor for e in energy])
    imgs.append(_png(fig))
    return imgs


def _table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{_esc(_fmt(c))}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


_KEY_FIGURES = {  # summary key: what the report calls it
    "world_size": "world size",
    "strategy": "strategy",
    "steps": "steps",
    "final_loss": "final loss",
    "eval": "evaluation",
    "samples_per_s": "throughput",
    "comm_bytes": "payload per rank, by collective",
    "comm_s": "communication (rank 0)",
    "sync_wait_s": "sync wait (rank 0)",
    "compute_s": "compute (rank 0)",
    "energy_j": "energy (all ranks)",
    "energy_source": "energy source",
    "param_norm": "parameter norm (L2)",
    "export": "exported model",
}
_RANK_COLUMNS = {  # summary key: column heading
    "rank": "rank",
    "step_s": "step time",
    "compute_s": "compute",
    "comm_s": "communication",
    "sync_wait_s": "sync wait",
    "energy_j": "energy",
    "peak_mem_bytes": "peak memory",
}


_MEMORY_COLUMNS = ("rank", "params", "grads", "optimizer", "activations", "total")


def _layout_section(summary: dict[str, Any]) -> list[str]:
    """The layout of a model-parallel run, its pipeline bubble and each rank's memory."""
    if "layout" not in summary:
        return []
    parts = ["<h2>Layout</h2>", _table(["setting", "value"], list(summary["layout"].items()))]
    bubble = summary.get("bubble")
    if bubble:
        rows = [
            ["measured (mean of stages)", bubble.get("measured")],
            ["formula (p-1)/(v m+p-1)", bubble.get("formula")],
        ]
        parts += ["<h3>Pipeline bubble</h3>", _table(["", "idle share"], rows)]
    memory = summary.get("memory_per_rank") or []
    if memory:
        rows = [
            [r.get("rank"), *(format_bytes(r.get(c, 0)) for c in _MEMORY_COLUMNS[1:])]
            for r in memory
        ]
        parts += ["<h3>Memory per rank</h3>", _table(list(_MEMORY_COLUMNS), rows)]
    return parts


def _plan_section(summary: dict[str, Any]) -> list[str]:
    """A run the planner laid out (``--strategy auto``): its pick, the prediction beside the
    measurement, and the timeline of one predicted step."""
    plan = summary.get("plan")
    if not plan:
        return []
    pred, meas = plan["predicted"], plan["measured"]

    def row(name: str, predicted: float | None, measured: float | None, scale: float) -> list:
        error = f"{(predicted - measured) / measured:+.0%}" if predicted and measured else "-"
        show = [f"{v * scale:.1f}" if v is not None else "-" for v in (predicted, measured)]
        return [name, *show, error]

    memory = pred["memory_bytes"]
    rows = [
        row("step time (ms)", pred["step_time_s"], meas["step_time_s"], 1e3),
        row("memory per device (MiB)", memory["total"], meas["memory_bytes"], 2**-20),
        row("activations (MiB)", memory["activations"], meas["activation_bytes"], 2**-20),
    ]
    mesh = ", ".join(f"{k}={v}" for k, v in plan["mesh"].items())
    parts = [
        "<h2>Plan</h2>",
        f"<p>--strategy auto chose --mesh {_esc(mesh)} {_esc(str(plan['parallel'] or ''))}; "
        f"{_esc('; '.join(plan['notes']))}</p>",
        _table(["", "predicted", "measured", "error"], rows),
        _png(_timeline(plan)),
    ]
    return parts


def _timeline(plan: dict[str, Any]) -> Figure:
    """One predicted step: a pipeline's schedule (the simulator's), otherwise compute then the
    exposed communication, to the predicted seconds."""
    from distml.plan.simulator import gantt_figure, simulate_pipeline

    layout, pred = plan["layout"], plan["predicted"]
    p, m = layout["pp"], plan["microbatches"]
    if p > 1 and layout["schedule"] in ("gpipe", "1f1b"):
        slot = pred["compute_s"] / m  # a micro-batch's forward + backward on a stage
        tasks = simulate_pipeline(p, m, slot / 3, 2 * slot / 3, schedule=layout["schedule"])
        return gantt_figure(tasks, p, f"predicted step: {p} stages, {m} micro-batches", "s")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 1.4), label="predicted step")
    ax = fig.add_subplot()
    ax.barh(0, pred["compute_s"], color="#4c72b0", label="compute")
    ax.barh(
        0, pred["comm_exposed_s"], left=pred["compute_s"], color="#dd8452", label="exposed comm"
    )
    ax.set_yticks([])
    ax.set_xlabel("s")
    ax.legend(loc="upper right", fontsize=7)
    ax.set_title("predicted step")
    fig.tight_layout()
    return fig


_SHARD_COLUMNS = ("version", "restored_version", "param_bytes", "bytes_pushed", "bytes_pulled")


def _ps_section(summary: dict[str, Any]) -> list[str]:
    """A parameter-server run: the staleness of its pushes, its workers and its shards."""
    ps = summary.get("ps")
    if not ps:
        return []
    parts = ["<h2>Parameter server</h2>"]
    staleness = {int(k): v for k, v in (ps.get("staleness") or {}).items()}
    if staleness:
        fig, ax = _figure("staleness", "Staleness of applied pushes", "versions behind", "pushes")
        ax.bar(list(staleness), list(staleness.values()))
        parts.append(_png(fig))
    rows = [
        [w["rank"], w["steps"], w["pushed"], format_rate(w["samples_per_s"])] for w in ps["workers"]
    ]
    parts.append(_table(["worker", "steps recorded", "pushes", "samples/s"], rows))
    rows = [
        [k, *(format_figure(c, s.get(c)) for c in _SHARD_COLUMNS), s["pushes"],
         format_seconds(s["queue_s"]["total"]), format_seconds(s["apply_s"]["median"])]
        for k, s in enumerate(ps["shards"])
    ]  # fmt: skip
    header = ["shard", *_SHARD_COLUMNS, "pushes", "queue (total)", "apply (median)"]
    parts.append(_table(header, rows))
    lost = ps.get("lost_workers") or []
    parts.append(f"<p>Lost workers: {_esc(lost or 'none')}.</p>")
    return parts


def write_report(run_dir: Path, per_rank: Records, summary: dict[str, Any]) -> Path:
    """Write run_dir/'report.html' and return its path."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    name = summary.get("run_name", run_dir.name)
    parts = [
        f"<h1>Run {_esc(name)}</h1>",
        "<h2>Summary</h2>",
        _table(
            ["figure", "value"],
            [
                [name, format_figure(k, summary[k])]
                for k, name in _KEY_FIGURES.items()
                if k in summary
            ],
        ),
        "<h2>Stragglers</h2>",
    ]
    stragglers = summary.get("stragglers") or []
    if stragglers:
        rows = [
            [s.get("rank"), format_seconds(s["median_compute_s"]), f"{s['ratio']:.2f}x"]
            for s in stragglers
        ]
        parts.append(_table(["rank", "median compute", "ratio to the others' median"], rows))
    else:
        parts.append("<p>None.</p>")
    ranks = summary.get("ranks") or []
    if ranks:
        parts.append("<h2>Per rank</h2>")
        rows = [[format_figure(k, r.get(k)) for k in _RANK_COLUMNS] for r in ranks]
        parts.append(_table(list(_RANK_COLUMNS.values()), rows))
    parts.extend(_plan_section(summary))
    parts.extend(_layout_section(summary))
    parts.extend(_ps_section(summary))
    plots = _plots(per_rank, summary)
    parts.append("<h2>Plots</h2>")
    parts.extend(plots or ["<p>No steps were recorded.</p>"])
    return write_html(run_dir / "report.html", name, parts)


def write_html(path: Path, title: str, parts: list[str]) -> Path:
    """One self-contained HTML page: ``parts`` (HTML fragments) under ``title``."""
    doc = (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{_esc(title)}</title><style>{_CSS}</style></head>\n<body>\n"
        + "\n".join(parts)
        + "\n</body></html>\n"
    )
    path.write_text(doc, encoding="utf-8")
    return path
