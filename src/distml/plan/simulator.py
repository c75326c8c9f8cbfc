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


# A transfer between neighbouring stages: ("f" activations / "b" gradients, sender, micro-batch).
_Transfer = tuple[str, int, int]


def _torch_1f1b(stage: int, p: int, m: int, forward_s: float, backward_s: float) -> list[tuple]:
    """One stage's program under torch.distributed.pipelining's ``Schedule1F1B``: ``("compute",
    seconds)``, ``("fire", transfers)`` (posts its sends or receives) and ``("wait",
    transfers)``. Warm-up forwards, each send waited on before the next is posted; then each
    backward's receive posted with the last forward's send and waited on together, and each
    forward's receive with the last backward's send; the cool-down backwards."""
    first, last = stage == 0, stage == p - 1

    def fwd(i: int, sender: int) -> list[_Transfer]:
        return [("f", sender, i)] if 0 <= sender < p - 1 else []

    def bwd(i: int, sender: int) -> list[_Transfer]:
        return [("b", sender, i)] if 0 < sender < p else []

    ops: list[tuple] = []

    def fire_and_wait(transfers: list[_Transfer]) -> None:
        ops.extend([("fire", transfers), ("wait", transfers)])

    warmup = min(m, p - stage)
    sending: list[_Transfer] = []
    sends: list[_Transfer] = []
    f = b = 0
    for _ in range(warmup):
        fire_and_wait(fwd(f, stage - 1))
        ops.append(("compute", forward_s))
        ops.append(("wait", sending))
        sends, sending = fwd(f, stage), []
        if f != warmup - 1:
            ops.append(("fire", sends))
            sending, sends = sends, []
        f += 1
    while True:
        fire_and_wait(sends + ([] if last else bwd(b, stage + 1)))
        ops.append(("compute", backward_s))
        sends = bwd(b, stage)
        b += 1
        if f == m:
            break
        fire_and_wait(sends + ([] if first else fwd(f, stage - 1)))
        ops.append(("compute", forward_s))
        sends = fwd(f, stage)
        f += 1
    ops.append(("fire", sends))
    sending = sends
    while b < m:
        fire_and_wait(bwd(b, stage + 1))
        ops.append(("compute", backward_s))
        ops.append(("wait", sending))
        sending = bwd(b, stage)
        ops.append(("fire", sending))
        b += 1
    ops.append(("wait", sending))
    return ops


def pipeline_step_s(
    p: int,
    m: int,
    forward_s: float,
    backward_s: float,
    message_bytes: float = 0.0,
    bandwidth: float = math.inf,
    exchange_bandwidth: float | None = None,
) -> float:
    """Seconds of one 1F1B step as torch's ``Schedule1F1B`` runs it, with ``message_bytes`` sent
    between neighbouring stages for every micro-batch each way (activations forward, their
    gradients back).

    A transfer starts once its sender and its receiver have both posted it (gloo meets them
    so) and the link is free that way; it moves at ``bandwidth``, or at ``exchange_bandwidth``
    (each way) while the link carries the other way too: a slow link with a shallow queue
    shares its rate between the two (BENCHMARKS.md, slow links). None: full duplex. Without
    transfers this is the schedule's ``(m + p - 1) (F + B)``."""
    both_ways = bandwidth if exchange_bandwidth is None else exchange_bandwidth
    programs = [_torch_1f1b(s, p, m, forward_s, backward_s) for s in range(p)]
    cursor = [0] * p
    busy_until = [0.0] * p
    waiting: list[list[_Transfer]] = [[] for _ in range(p)]
    posted: dict[_Transfer, int] = {}  # sides that posted it (2: both)
    queued: dict[tuple[int, str], list[_Transfer]] = {}  # (link, way): waiting for the link
    moving: dict[tuple[int, str], list] = {}  # (link, way): [transfer, bytes left]
    done: set[_Transfer] = set()
    now = 0.0
    while True:
        progressed = True
        while progressed:  # every stage as far as it goes without time passing
            progressed = False
            for s in range(p):
                if busy_until[s] > now or not all(t in done for t in waiting[s]):
                    continue
                waiting[s] = []
                if cursor[s] == len(programs[s]):
                    continue
                op, arg = programs[s][cursor[s]]
                cursor[s] += 1
                progressed = True
                if op == "compute":
                    busy_until[s] = now + arg
                elif op == "wait":
                    waiting[s] = list(arg)
                else:
                    for transfer in arg:
                        posted[transfer] = posted.get(transfer, 0) + 1
                        if posted[transfer] == 2:
                            way, sender, _ = transfer
                            link = sender if way == "f" else sender - 1
                            queued.setdefault((link, way), []).append(transfer)
        for key, line in queued.items():
            while line and key not in moving:
                transfer = line.pop(0)
                if message_bytes > 0 and bandwidth < math.inf:
                    moving[key] = [transfer, message_bytes]
                else:  # nothing to move, or no time to move it in
                    done.add(transfer)
        if any(all(t in done for t in waiting[s]) and waiting[s] for s in range(p)):
            continue  # a stage can go on at once
        if not moving and all(
            cursor[s] == len(programs[s]) and not waiting[s] and busy_until[s] <= now
            for s in range(p)
        ):
            return now
        rates = {
            (link, way): both_ways if (link, "b" if way == "f" else "f") in moving else bandwidth
            for link, way in moving
        }
        ends = [t for t in busy_until if t > now]
        ends += [now + left / rates[key] for key, (_, left) in moving.items()]
        if not ends:
            raise RuntimeError("the schedule deadlocked")  # a bug in _torch_1f1b
        step_to = min(ends)
        for key in list(moving):
            moving[key][1] -= (step_to - now) * rates[key]
            if moving[key][1] <= 1e-9 * message_bytes:
                done.add(moving.pop(key)[0])
        now = step_to


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
