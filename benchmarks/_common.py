"""Shared helpers for the benchmarks: timing inside workers, machine info, tables, JSON."""

from __future__ import annotations

import argparse
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


def busy_cpu_s() -> float:
    """CPU seconds all cores have been busy since boot (/proc/stat); 0 where unavailable."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    except (OSError, ValueError):
        return 0.0
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # less idle, iowait


def busy_fraction(seconds: float = 1.0) -> float:
    """Share of all cores busy over ``seconds``."""
    before = busy_cpu_s()
    time.sleep(seconds)
    return (busy_cpu_s() - before) / (seconds * (os.cpu_count() or 1))


def wait_until_quiet(threshold: float, max_wait_s: float) -> float:
    """Wait (up to ``max_wait_s``) until under ``threshold`` of the CPUs are busy; return it."""
    deadline = time.monotonic() + max_wait_s
    busy = busy_fraction()
    while busy > threshold and time.monotonic() < deadline:
        busy = busy_fraction()
    return busy


def add_noise_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quiet",
        type=float,
        default=0.25,
        help="before each run, wait until under this share of the CPUs is busy",
    )
    parser.add_argument("--max-wait", type=float, default=60.0, help="seconds; 0: do not wait")
    parser.add_argument(
        "--max-foreign",
        type=float,
        default=0.05,
        help="redo a run if other processes took more than this CPU share",
    )
    parser.add_argument("--retries", type=int, default=2, help="redos per run, at most")


def measured(run: Callable[[], dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """``run()`` once the machine is quiet, again while other work disturbed it (see above)."""
    for attempt in range(args.retries + 1):
        busy = wait_until_quiet(args.quiet, args.max_wait) if args.max_wait > 0 else float("nan")
        res = run()
        res.update(busy_before=busy, attempts=attempt + 1)
        if res["foreign_share"] <= args.max_foreign:
            break
    return res


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

    Every rank calls it. Returns this rank's wall time of the timed steps, each step's duration,
    each rank's CPU seconds per wall second (all its threads; ~1 for an undisturbed one-thread
    worker), and ``foreign_share``: the share of the machine's CPU time over the timed steps
    that went to other processes (other work on the machine, the launcher's agent): the noise.
    """
    for i in range(warmup):
        step(batches[i % len(batches)])
    dist.barrier()
    busy0, cpu0 = busy_cpu_s(), time.process_time()
    marks = [time.perf_counter()]
    for i in range(steps):
        step(batches[(warmup + i) % len(batches)])
        marks.append(time.perf_counter())
    cpu, busy = time.process_time() - cpu0, busy_cpu_s() - busy0
    wall = marks[-1] - marks[0]
    cpus: list[float] = [0.0] * dist.get_world_size()
    dist.all_gather_object(cpus, cpu)  # after the clock stopped
    foreign = max(0.0, busy - sum(cpus)) / (wall * (os.cpu_count() or 1))
    return {
        "wall_s": wall,
        "step_s": [b - a for a, b in zip(marks[:-1], marks[1:], strict=True)],
        "cpu_per_wall": [c / wall for c in cpus],
        "foreign_share": foreign,
    }


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
