"""TensorBoard event files beside metrics.jsonl: read back with tensorboard's own reader, every
scalar is the one that metrics.jsonl (or, for a federated run, history.json) holds, at the same
step, to float32 precision (the precision of an event file's scalars)."""

from __future__ import annotations

import json
import logging
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from tiny_run import shared_tiny_run

from conftest import read_events
from distml.federated.server import ServerConfig
from distml.federated.strategy import LocalConfig, make_strategy
from distml.jobs.fl_simulation import SimulationConfig, simulate
from distml.telemetry import metrics_stream
from distml.telemetry.federated_report import write_federated_report
from distml.telemetry.metrics_stream import write_metrics


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_tiny_run(tmp_path_factory)


FLOAT32_EPS = 2.0**-23
RANK_TAGS = {  # metrics.jsonl key: the tag under rank<r>/
    "loss": "loss",
    "step_s": "step_time_s",
    "compute_s": "compute_s",
    "comm_s": "comm_s",
    "sync_wait_s": "sync_wait_s",
    "energy_j": "energy_j",
    "peak_mem_bytes": "peak_mem_bytes",
}


def expected_from_jsonl(
    lines: list[dict], eval_metrics: dict
) -> dict[str, list[tuple[int, float]]]:
    """What the event files should hold, derived from metrics.jsonl as the module's doc says."""
    out: dict[str, list[tuple[int, float]]] = defaultdict(list)
    losses, rates, energy = defaultdict(list), defaultdict(float), defaultdict(float)
    for line in lines:
        step, rank = line["step"], f"rank{line['rank']}"
        for key, tag in RANK_TAGS.items():
            out[f"{rank}/{tag}"].append((step, line[key]))
        for key in ("comm_bytes", "wire_bytes"):
            for collective, n in line[key].items():
                out[f"{rank}/{key}/{collective}"].append((step, n))
        out[f"{rank}/samples_per_s"].append((step, line["samples"] / line["step_s"]))
        losses[step].append(line["loss"])
        rates[step] += line["samples"] / line["step_s"]
        energy[step] += line["energy_j"]
    for step in sorted(losses):
        out["loss"].append((step, sum(losses[step]) / len(losses[step])))
        out["samples_per_s"].append((step, rates[step]))
        out["energy_j"].append((step, energy[step]))
    for name, value in eval_metrics.items():
        out[f"eval/{name}"].append((max(losses), value))
    return dict(out)


def assert_same_scalars(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    for tag, series in expected.items():
        assert [s for s, _ in got[tag]] == [s for s, _ in series], tag
        for (step, value), (_, want) in zip(got[tag], series, strict=True):
            assert abs(value - want) <= FLOAT32_EPS * abs(want), (tag, step, value, want)


@pytest.mark.distributed
def test_event_files_hold_what_metrics_jsonl_holds(tiny_run: Path) -> None:
    got = read_events(tiny_run / "tb")
    lines = [json.loads(line) for line in (tiny_run / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((tiny_run / "summary.json").read_text())
    assert len(lines) == 2 * summary["steps"]
    assert_same_scalars(got, expected_from_jsonl(lines, summary["eval"]))
    # What the tags promise: each rank's step time and bytes by collective, at every step.
    steps = list(range(summary["steps"]))
    for rank in (0, 1):
        assert [s for s, _ in got[f"rank{rank}/step_time_s"]] == steps
        assert [s for s, _ in got[f"rank{rank}/comm_bytes/all_reduce"]] == steps
    assert {"eval/accuracy", "eval/loss"} <= got.keys()


def test_a_rerun_replaces_the_event_files_of_the_last(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    record = {"step": 0, "rank": 0, "loss": 2.0, "samples": 8, "step_s": 0.5, "compute_s": 0.4,
              "comm_s": 0.1, "sync_wait_s": 0.0, "energy_j": 1.0, "peak_mem_bytes": 10,
              "comm_bytes": {}, "wire_bytes": {}}  # fmt: skip
    write_metrics(tmp_path, [[record]])
    write_metrics(tmp_path, [[{**record, "loss": 1.0}]])
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1
    assert read_events(tmp_path / "tb")["loss"] == [(0, 1.0)]


@pytest.fixture
def without_tensorboard(monkeypatch: pytest.MonkeyPatch):
    """torch's SummaryWriter made unimportable, as where tensorboard is not installed."""
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    metrics_stream._summary_writer.cache_clear()
    yield
    metrics_stream._summary_writer.cache_clear()


def test_without_tensorboard_the_run_writes_jsonl_and_says_so_once(
    tmp_path: Path, without_tensorboard: None, caplog: pytest.LogCaptureFixture
) -> None:
    record = {"step": 0, "rank": 0, "loss": 2.0, "samples": 8, "step_s": 0.5}
    with caplog.at_level(logging.WARNING, logger="distml.telemetry"):
        for name in ("first", "second"):
            path = write_metrics(tmp_path / name, [[record]])
            assert [json.loads(line) for line in path.read_text().splitlines()] == [record]
            assert not (tmp_path / name / "tb").exists()
    warnings = [r for r in caplog.records if "TensorBoard" in r.getMessage()]
    assert len(warnings) == 1
    assert "pip install 'distml[tensorboard]'" in warnings[0].getMessage()


@pytest.mark.distributed
def test_a_federated_simulation_writes_its_rounds_as_events(tmp_path: Path) -> None:
    """As ``distml fl simulate --out`` does: the rounds' history, then the report beside it."""
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    history: list[dict] = []
    summary = simulate(
        SimulationConfig(clients=4, processes=1),
        ServerConfig(rounds=2, min_available=4),
        make_strategy("fedavg", fraction_fit=1.0, local=LocalConfig()),
        on_round=history.append,
    )
    write_federated_report(tmp_path, history, summary)
    expected: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for entry in history:
        for key, value in entry.items():
            if key != "round" and isinstance(value, int | float) and not isinstance(value, bool):
                expected[key].append((entry["round"], value))
    got = read_events(tmp_path / "tb")
    assert_same_scalars(got, dict(expected))
    assert [s for s, _ in got["accuracy"]] == [1, 2] and {"bytes_up", "energy_j"} <= got.keys()
