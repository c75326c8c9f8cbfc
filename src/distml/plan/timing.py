"""Timing a piece of work the way every measurement of the planner does."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs, after one warm-up."""
    return statistics.median(_times(fn, repeats))


def mean_time(fn: Callable[[], Any], repeats: int) -> float:
    """Mean seconds of ``fn()`` over ``repeats`` runs, after one warm-up: what a run takes in a
    long sequence of them, where the few slow ones (a transfer TCP had to recover on a lossy
    link) count in full, as they do in a step that sums many."""
    return statistics.fmean(_times(fn, repeats))


def best_time(fn: Callable[[], Any], repeats: int) -> float:
    """Shortest seconds of ``fn()`` over ``repeats`` runs, after one warm-up: what the work
    takes undisturbed, where other processes on the same cores only ever slow it down."""
    return min(_times(fn, repeats))


def _times(fn: Callable[[], Any], repeats: int) -> list[float]:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times
