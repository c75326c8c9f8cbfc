"""The planner's two ways to time a piece of work: the median for what a run typically takes,
the mean for what a long sequence of runs takes, slow ones included."""

from __future__ import annotations

import itertools

from distml.plan import timing


def clock_of_runs(monkeypatch, seconds: list[float]) -> None:
    """A clock under which the timed runs take ``seconds`` in turn (each is read at its start
    and end)."""
    ticks = itertools.accumulate(itertools.chain.from_iterable((0.0, s) for s in seconds))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(ticks))


def test_the_mean_counts_the_slow_runs_that_the_median_leaves_out(monkeypatch):
    bursts = [1.0, 1.0, 2.0, 1.0, 2.0]  # a lossy link: some bursts take twice as long
    for how, expected in ((timing.median_time, 1.0), (timing.mean_time, 1.4)):
        clock_of_runs(monkeypatch, bursts)
        calls = []
        assert how(lambda calls=calls: calls.append(1), 5) == expected
        assert len(calls) == 6  # one warm-up, untimed
