"""The simulator against the formulas it must reproduce."""

from __future__ import annotations

import pytest

from distml.plan.simulator import (
    bubble_of,
    draw_gantt,
    peak_in_flight,
    simulate_failures,
    simulate_pipeline,
    simulate_stragglers,
    young_daly_interval,
)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 8)])
def test_bubble_matches_p_minus_1_over_m_plus_p_minus_1(schedule, p, m):
    tasks = simulate_pipeline(p, m, 1.0, 2.0, schedule)
    assert len(tasks) == 2 * p * m
    assert bubble_of(tasks, p) == pytest.approx((p - 1) / (m + p - 1))


def test_1f1b_holds_at_most_p_micro_batches_gpipe_all_m():
    p, m = 4, 16
    assert peak_in_flight(simulate_pipeline(p, m, schedule="1f1b"), 0) == p
    assert peak_in_flight(simulate_pipeline(p, m, schedule="gpipe"), 0) == m


def test_gantt_chart_is_a_png(tmp_path):
    path = draw_gantt(simulate_pipeline(4, 8), 4, tmp_path / "gantt.png")
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_backup_workers_and_async_beat_sync_under_stragglers():
    r = simulate_stragglers(workers=32, steps=400, backup=2, tail=0.5)
    assert r["sync"] < r["backup"] < r["async"]
    # Without variation there is nothing to gain.
    flat = simulate_stragglers(workers=8, steps=50, backup=0, tail=0.0)
    assert flat["sync"] == pytest.approx(8.0) and flat["async"] == pytest.approx(8.0)


def test_best_checkpoint_interval_is_near_young_daly():
    mtbf, delta, restart = 3600.0, 60.0, 30.0
    grid = [100, 200, 400, 600, 900, 1200, 1800, 3000]
    goodput = {
        t: sum(simulate_failures(2e5, t, delta, restart, mtbf, seed=s) for s in range(20)) / 20
        for t in grid
    }
    best = max(goodput, key=goodput.get)
    optimum = young_daly_interval(delta, mtbf)  # about 657 s
    assert optimum / 1.6 <= best <= optimum * 1.6
    assert goodput[best] > goodput[100] and goodput[best] > goodput[3000]
