"""The planner's ways to time a piece of work: the median for what a run typically takes, the
mean for what a long sequence of runs takes, slow ones included, and the best for what it takes
undisturbed."""

from __future__ import annotations

import itertools

import pytest

from distml.plan import timing


def clock_of_runs(monkeypatch, seconds: list[float]) -> None:
    """A clock under which the timed runs take ``seconds`` in turn (each is read at its start
    and end)."""
    ticks = itertools.accumulate(itertools.chain.from_iterable((0.0, s) for s in seconds))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(ticks))


def test_the_median_the_mean_and_the_best_of_the_same_runs(monkeypatch):
    runs = [0.5, 1.0, 2.0, 1.0, 2.0]  # a lossy link: some bursts take twice as long
    for how, expected in (
        (timing.median_time, 1.0),
        (timing.mean_time, 1.3),  # the slow ones count in full
        (timing.best_time, 0.5),
    ):
        clock_of_runs(monkeypatch, runs)
        calls = []
        assert how(lambda calls=calls: calls.append(1), 5) == pytest.approx(expected)
        assert len(calls) == 6  # one warm-up, untimed
