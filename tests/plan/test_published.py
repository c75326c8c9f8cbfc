"""The planner against published large-model training runs: the goal of
``benchmarks/plan_published.py``, checked in process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distml.plan.devices import CHIPS
from distml.plan.published import (
    GOAL_MAX,
    GOAL_SHARE,
    GOAL_WITHIN,
    HALVES,
    best_layout_gap,
    cross_validate,
    evaluate,
    family_of,
    fit_sustained,
    flop_consistency,
    load,
    tuned,
)

RUNS = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "published_runs.json"


@pytest.fixture(scope="module")
def published():
    return load(RUNS)


def assert_goal(results):
    errors = {r.run.id: r.error for r in results}
    within = sum(abs(e) <= GOAL_WITHIN for e in errors.values())
    assert within / len(errors) >= GOAL_SHARE, errors
    assert max(abs(e) for e in errors.values()) <= GOAL_MAX, errors


def test_the_runs_are_many_cited_and_from_independent_sources(published):
    sources, runs = published
    assert len(runs) >= 15 and len({r.source for r in runs}) >= 4
    for run in runs:
        assert run.source in sources and run.row["cite"], run.id
        assert run.published_step_s > 0
    for source in sources.values():
        assert source["url"].startswith("https://") and source["where"] and source["flops"]
    # Narayanan et al. 2021 (SC21) Table 1 is kept out as an independent check.
    text = RUNS.read_text()
    assert "2104.04473" not in text and "megatron-sc21" not in text.lower()


def test_published_runs_meet_the_goal_with_the_shipped_constants(published):
    _, runs = published
    assert_goal(evaluate(runs))


def test_constants_fitted_on_half_the_sources_predict_the_other_half(published):
    _, runs = published
    assert {r.source for r in runs} == HALVES[0] | HALVES[1]
    tested = []
    for fold in cross_validate(runs, HALVES):
        tested += fold["results"]
    assert len(tested) == len(runs)
    assert_goal(tested)


def test_the_shipped_constants_are_the_fit_on_every_run(published):
    _, runs = published
    fitted = fit_sustained(runs)
    for name, chip in CHIPS.items():
        if family_of(name) in fitted:
            assert chip.sustained == pytest.approx(fitted[family_of(name)], abs=0.01), name


def test_each_source_is_read_with_its_own_flop_count(published):
    _, runs = published
    checks = flop_consistency(runs)
    assert len(checks) >= 10
    for check in checks:
        assert check["derived"] == pytest.approx(check["published"], rel=0.02), check


def test_published_layouts_fit_and_are_near_the_planners_best(published):
    _, runs = published
    for result in evaluate(runs):
        memory = result.prediction.memory_bytes["total"]
        assert memory <= result.run.cluster.device.memory_bytes, result.run.id
    # A few runs with small searches (the test stays fast): all near the best.
    small = [r for r in runs if r.cluster.devices <= 280 and r.source == "korthikanti2022"]
    gaps = [best_layout_gap(tuned(run))[0] for run in small]
    assert len(gaps) >= 3 and all(gap <= 0.10 for gap in gaps), gaps


def test_unstated_settings_are_the_planners_best_and_say_so(published):
    _, runs = published
    for run in runs:
        for setting in run.row.get("unstated", []):
            assert setting in run.row["assumed"], (run.id, setting)
    megatron = next(r for r in runs if r.id == "megatron2024-462b")
    chosen = tuned(megatron)
    assert chosen.layout.schedule == "interleaved" and chosen.layout.chunks > 1
    data = json.loads(RUNS.read_text())
    assert all("assumed" in row for row in data["runs"])
