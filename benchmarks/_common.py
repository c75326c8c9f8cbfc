"""Shared helpers for the benchmarks: timing inside workers, machine info, tables, JSON."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict[str, Any]:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_at_start": load,
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }


def load_now() -> float:
    """The 1-minute load average: a hint that other work shared the machine."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def _cpu_ticks() -> tuple[int, int]:
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


def busy_fraction(seconds: float = 1.0) -> float:
    """Share of all cores busy over ``seconds`` (from /proc/stat); 0 where unavailable."""
    try:
        busy0, total0 = _cpu_ticks()
        time.sleep(seconds)
        busy1, total1 = _cpu_ticks()
    except (OSError, ValueError, IndexError):
        return 0.0
    return (busy1 - busy0) / max(total1 - total0, 1)


def wait_until_quiet(threshold: float, max_wait_s: float) -> float:
    """Wait (up to ``max_wait_s``) until under ``threshold`` of the CPUs are busy; return it."""
    deadline = time.monotonic() + max_wait_s
    busy = busy_fraction()
    while busy > threshold and time.monotonic() < deadline:
        busy = busy_fraction()
    return busy


def random_batches(
    n: int, batch: int, shape: tuple[int, ...], classes: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` fixed (input, label) batches, drawn from a generator seeded by ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn((batch, *shape), generator=gen)
        out.append((x, torch.randint(0, classes, (batch,), generator=gen)))
    return out


def timed_steps(
    step: Callable[[Any], object], batches: Sequence[Any], warmup: int, steps: int
) -> dict[str, Any]:
    """Run ``warmup`` untimed steps, a barrier, then ``steps`` timed ones (perf_counter).

    Returns the wall time of the timed steps on this rank and each step's duration.
    """
    for i in range(warmup):
        step(batches[i % len(batches)])
    if dist.is_initialized():
        dist.barrier()
    cpu0 = time.process_time()
    marks = [time.perf_counter()]
    for i in range(steps):
        step(batches[(warmup + i) % len(batches)])
        marks.append(time.perf_counter())
    wall = marks[-1] - marks[0]
    durations = [b - a for a, b in zip(marks[:-1], marks[1:], strict=True)]
    # CPU seconds of this process (all threads) per wall second: ~1 for an undisturbed
    # one-thread worker; well below 1 when something else took the core.
    cpu_per_wall = (time.process_time() - cpu0) / wall
    return {"wall_s": wall, "step_s": durations, "cpu_per_wall": cpu_per_wall}


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def spread(values: Sequence[float]) -> str:
    """``min..max`` of a sample, for the table."""
    return f"{min(values):,.1f}..{max(values):,.1f}" if values else "-"


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    table = Table(title=title)
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    console = Console()
    if not console.is_terminal:
        console = Console(width=140)
    console.print(table)


@contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    """A temporary runs_dir, removed on success and kept (with the workers' logs) on failure."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    except BaseException:
        print(f"run directories and worker logs kept in {path}", file=sys.stderr)
        raise
    shutil.rmtree(path, ignore_errors=True)


def write_json(name: str, payload: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path
