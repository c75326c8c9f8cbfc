"""The simulator against the formulas it must reproduce."""

from __future__ import annotations

import pytest

from distml.plan.simulator import (
    bubble_of,
    draw_gantt,
    peak_in_flight,
    pipeline_step_s,
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


@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (3, 2), (4, 8), (8, 4)])
def test_torchs_1f1b_without_transfers_takes_the_schedules_time(p, m):
    tasks = simulate_pipeline(p, m, 1.0, 2.0, "1f1b")
    assert pipeline_step_s(p, m, 1.0, 2.0) == pytest.approx(max(t.end for t in tasks))
    assert pipeline_step_s(p, m, 1.0, 2.0, 1e6, float("inf")) == pytest.approx((m + p - 1) * 3)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_one_micro_batch_waits_for_every_transfer(p):
    # Forward through p stages and back: p forwards, p backwards, 2 (p - 1) transfers of 0.5.
    assert pipeline_step_s(p, 1, 1.0, 2.0, message_bytes=1.0, bandwidth=2.0) == pytest.approx(
        3 * p + (p - 1)
    )


def test_a_link_that_shares_its_rate_both_ways_is_slower_than_full_duplex():
    p, m, forward, transfer = 2, 4, 0.1, 1.0
    compute = (m + p - 1) * 3 * forward
    duplex = pipeline_step_s(p, m, forward, 2 * forward, 1.0, 1.0)
    shared = pipeline_step_s(p, m, forward, 2 * forward, 1.0, 1.0, exchange_bandwidth=0.5)
    end_to_end = compute + 2 * m * (p - 1) * transfer  # every transfer on the critical path
    assert compute < duplex < shared <= end_to_end + 1e-9
    # Shared both ways, the link moves the step's 2m transfers at one way's rate at best.
    assert shared >= 2 * m * transfer


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
