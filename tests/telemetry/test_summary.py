"""Telemetry: waits and stragglers from their definitions, energy counters, the run folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import distml
from distml.models import MLP
from distml.telemetry.energy import RaplCounter
from distml.telemetry.summary import attribute_waits, find_stragglers, summarize

DESIGN_FIELDS = {
    "world_size",
    "strategy",
    "steps",
    "final_loss",
    "eval",
    "samples_per_s",
    "comm_bytes",
    "comm_s",
    "sync_wait_s",
    "stragglers",
    "energy_j",
    "energy_source",
    "param_norm",
    "export",
}


def rec(compute: float, exposed: float) -> dict:
    return {"compute_s": compute, "exposed_comm_s": exposed}


def test_wait_is_the_gap_to_the_slowest_rank():
    per_rank = [[rec(1.0, 0.7)], [rec(1.5, 0.2)], [rec(1.2, 0.1)]]
    attribute_waits(per_rank)
    # rank 0 waited 0.5 s of its 0.7 s for rank 1; rank 1 (the slowest) waited for no one;
    # rank 2's gap is 0.3 s but it saw only 0.1 s exposed: all of that is wait.
    assert [r[0]["sync_wait_s"] for r in per_rank] == pytest.approx([0.5, 0.0, 0.1])
    assert [r[0]["comm_s"] for r in per_rank] == pytest.approx([0.2, 0.2, 0.0])


def step(seconds: float, samples: int = 10) -> dict:
    return {"step_s": seconds, "samples": samples, "loss": 1.0, "compute_s": seconds,
            "comm_s": 0.0, "sync_wait_s": 0.0, "energy_j": 0.0, "peak_mem_bytes": 0,
            "comm_bytes": {}, "wire_bytes": {}}  # fmt: skip


def test_throughput_of_ranks_in_lockstep_and_of_ranks_that_took_different_shares():
    # In lockstep each step lasts as long as its slowest rank: 2 steps of 0.3 s, 40 samples.
    lockstep = summarize([[step(0.1), step(0.3)], [step(0.3), step(0.1)]], 1.25, True)
    assert lockstep["train_s"] == pytest.approx(0.6)
    assert lockstep["samples_per_s"] == pytest.approx(40 / 0.6)
    # A rank's extra record (one the others never matched) is no step of the run's.
    extra = summarize([[step(0.1), step(0.3), step(0.2)], [step(0.3), step(0.1)]], 1.25, True)
    assert extra["steps"] == 2 and extra["samples_per_s"] == pytest.approx(40 / 0.6)
    # Asynchronous workers run side by side: the fast one took 3 batches while the slow one
    # took 1, and training lasted as long as the busiest of them.
    apart = summarize([[step(0.1)] * 3, [step(0.3)]], 1.25, True, lockstep=False)
    assert apart["train_s"] == pytest.approx(0.3)
    assert apart["samples_per_s"] == pytest.approx(40 / 0.3)
    assert apart["steps"] == 3  # rank 0's, all of them


def test_stragglers_are_ranks_slower_than_factor_times_the_others_median():
    per_rank = [[rec(c, 0)] * 3 for c in (1.0, 1.1, 0.9, 2.0)]
    found = find_stragglers(per_rank, factor=1.25)
    assert [s["rank"] for s in found] == [3]
    assert found[0]["ratio"] == pytest.approx(2.0 / 1.0)
    two = find_stragglers([[rec(1.0, 0)], [rec(3.0, 0)]], factor=1.25)
    assert [(s["rank"], s["ratio"]) for s in two] == [(1, pytest.approx(3.0))]


def test_rapl_counter_sums_deltas_and_survives_wraparound(tmp_path: Path):
    zone = tmp_path / "intel-rapl:0"
    zone.mkdir()
    (zone / "max_energy_range_uj").write_text("1000000\n")
    counter = zone / "energy_uj"
    counter.write_text("900000\n")
    meter = RaplCounter([counter], reads=True)
    counter.write_text("950000\n")
    assert meter.read() == pytest.approx(0.05)
    counter.write_text("100000\n")  # wrapped: +50,000 to the top, +100,000 after
    assert meter.read() == pytest.approx(0.2)
    assert RaplCounter([counter], reads=False).read() == 0.0


def straggler_worker(ctx: distml.Context) -> dict:
    model = MLP((64, 256, 256, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = ctx.setup(model, optimizer)
    g = torch.Generator().manual_seed(ctx.rank)
    for _ in range(15):
        x, y = torch.randn(512, 64, generator=g), torch.randint(0, 10, (512,), generator=g)
        ctx.train_step((x, y), lambda b: F.cross_entropy(model(b[0]), b[1]))
    return ctx.finish(eval={"note": 1.0})


@pytest.mark.distributed
def test_a_simulated_straggler_is_named_and_the_others_wait_for_it(tmp_path: Path):
    summary = distml.launch(
        straggler_worker,
        nproc=2,
        runs_dir=tmp_path,
        run_name="slow",
        telemetry={"simulate_straggler": (1, 4.0), "progress": False},
    )
    assert DESIGN_FIELDS <= summary.keys()
    assert [s["rank"] for s in summary["stragglers"]] == [1]
    assert summary["stragglers"][0]["ratio"] > 2.0
    fast, slow = summary["ranks"]
    assert fast["sync_wait_s"] > 2 * slow["sync_wait_s"]
    assert summary["energy_source"].startswith(("measured:", "estimated:"))
    assert summary["energy_j"] > 0
    run = tmp_path / "slow"
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 * 15
    assert {
        "step",
        "rank",
        "step_s",
        "compute_s",
        "comm_s",
        "sync_wait_s",
        "comm_bytes",
        "samples",
        "peak_mem_bytes",
        "energy_j",
    } <= lines[0].keys()
    on_disk = json.loads((run / "summary.json").read_text())
    assert on_disk["param_norm"] == pytest.approx(summary["param_norm"])
    assert Path(on_disk["report"]).exists()
