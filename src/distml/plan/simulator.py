"""Discrete-event simulation of the scale we cannot run here.

- :func:`simulate_pipeline`: one step of a pipeline schedule (GPipe or 1F1B) over ``p`` stages and
  ``m`` micro-batches, each task starting when its inputs exist and its stage is free; the
  timeline can be drawn as a Gantt chart.
- :func:`simulate_stragglers`: steps of N workers whose compute times are random: synchronous SGD
  waits for the slowest, backup workers (Chen et al. 2016) for the N fastest of N+b, asynchronous
  SGD for nobody.
- :func:`simulate_failures`: a long job on many devices with exponential failures, periodic
  checkpoints and restarts; its goodput against the checkpoint interval, beside the Young/Daly
  optimum ``sqrt(2 * delta * M)`` (Young 1974; Daly 2006).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

# matplotlib is imported only to draw a Gantt chart: it costs about a second.

if TYPE_CHECKING:
    from matplotlib.figure import Figure


@dataclass(frozen=True)
class Task:
    stage: int
    micro: int
    kind: str  # "F" or "B"
    start: float
    end: float


def _order(schedule: str, stage: int, p: int, m: int) -> list[tuple[str, int]]:
    """The order in which one stage runs its forward and backward passes."""
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if schedule != "1f1b":
        raise ValueError(f"unknown schedule {schedule!r}: gpipe or 1f1b")
    warmup = min(p - stage - 1, m)
    order = [("F", i) for i in range(warmup)]
    f, b = warmup, 0
    while b < m:
        if f < m:
            order.append(("F", f))
            f += 1
        order.append(("B", b))
        b += 1
    return order


def simulate_pipeline(
    p: int, m: int, forward_s: float = 1.0, backward_s: float = 2.0, schedule: str = "1f1b"
) -> list[Task]:
    """Every task of one step. A stage's forward of micro-batch i needs the previous stage's;
    its backward needs its own forward and the next stage's backward."""
    orders = [_order(schedule, s, p, m) for s in range(p)]
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * p
    cursor = [0] * p
    tasks: list[Task] = []
    while len(tasks) < 2 * p * m:
        progressed = False
        for s in range(p):
            if cursor[s] == len(orders[s]):
                continue
            kind, i = orders[s][cursor[s]]
            if kind == "F":
                deps = [("F", s - 1, i)] if s > 0 else []
            else:
                deps = [("F", s, i)] + ([("B", s + 1, i)] if s < p - 1 else [])
            if not all(d in done for d in deps):
                continue
            start = max([free[s]] + [done[d] for d in deps])
            end = start + (forward_s if kind == "F" else backward_s)
            done[(kind, s, i)] = end
            free[s] = end
            cursor[s] += 1
            tasks.append(Task(s, i, kind, start, end))
            progressed = True
        if not progressed:
            raise RuntimeError("the schedule deadlocked")  # a bug in _order, never user input
    return tasks


def bubble_of(tasks: list[Task], p: int) -> float:
    """Share of stage time spent idle within the step."""
    makespan = max(t.end for t in tasks)
    busy = sum(t.end - t.start for t in tasks)
    return 1 - busy / (p * makespan)


def peak_in_flight(tasks: list[Task], stage: int) -> int:
    """Most micro-batches whose activations a stage holds at once (forward done, backward not)."""
    events = sorted(
        (t.end if t.kind == "F" else t.start, 1 if t.kind == "F" else -1)
        for t in tasks
        if t.stage == stage
    )
    level = peak = 0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    return peak


def draw_gantt(tasks: list[Task], p: int, path: Path, title: str = "") -> Path:
    gantt_figure(tasks, p, title).savefig(path, dpi=100)
    return Path(path)


def gantt_figure(tasks: list[Task], p: int, title: str = "", unit: str = "time") -> Figure:
    """One step's timeline: a row per stage, a bar per forward (F) and backward (B)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 0.5 + 0.45 * p))
    ax = fig.add_subplot()
    for t in tasks:
        color = "#4c72b0" if t.kind == "F" else "#dd8452"
        ax.barh(t.stage, t.end - t.start, left=t.start, color=color, edgecolor="white")
        ax.text(
            (t.start + t.end) / 2,
            t.stage,
            f"{t.kind}{t.micro}",
            ha="center",
            va="center",
            fontsize=7,
            color="white",
        )
    ax.set_yticks(range(p), [f"stage {s}" for s in range(p)])
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_title(title or f"{p} stages, bubble {bubble_of(tasks, p):.1%}")
    fig.tight_layout()
    return fig


def simulate_stragglers(
    workers: int, steps: int, backup: int = 0, tail: float = 0.3, seed: int = 0
) -> dict[str, float]:
    """Throughput (worker-steps per unit time) of sync, backup-worker and async SGD when each
    compute time is 1 plus an exponential tail with mean ``tail``."""
    rng = random.Random(seed)

    def draw() -> float:
        return 1.0 + rng.expovariate(1 / tail) if tail > 0 else 1.0

    sync_time = backup_time = 0.0
    for _ in range(steps):
        times = [draw() for _ in range(workers + backup)]
        sync_time += max(times[:workers])  # N workers, no backups: wait for the slowest
        backup_time += sorted(times)[workers - 1]  # N+b workers: the N-th to finish
    async_rate = workers / (1.0 + tail)  # each worker goes at its own mean pace
    return {
        "sync": workers * steps / sync_time,
        "backup": workers * steps / backup_time,
        "async": async_rate,
    }


def young_daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum checkpoint interval ``sqrt(2 * delta * M)``."""
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def simulate_failures(
    work_s: float,
    interval_s: float,
    checkpoint_s: float,
    restart_s: float,
    mtbf_s: float,
    seed: int = 0,
) -> float:
    """Goodput (useful work / wall time) of a job that checkpoints every ``interval_s`` of work
    and, on a failure (exponential, mean ``mtbf_s`` for the whole job), restarts from the last
    checkpoint."""
    rng = random.Random(seed)
    wall, saved = 0.0, 0.0
    next_failure = rng.expovariate(1 / mtbf_s)
    while saved < work_s:
        segment = min(interval_s, work_s - saved) + checkpoint_s
        if wall + segment <= next_failure:
            wall += segment
            saved += segment - checkpoint_s
            continue
        wall = next_failure + restart_s  # the segment is lost
        next_failure = wall + rng.expovariate(1 / mtbf_s)
    return work_s / wall
