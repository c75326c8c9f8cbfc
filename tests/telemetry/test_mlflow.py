"""An MLflow run beside metrics.jsonl and the event files: read back with MLflow's own client,
every metric is the scalar TensorBoard gets, at the same step; the settings are its parameters,
and a store that refuses, or no mlflow at all, costs the run a warning and nothing else."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
from test_event_files import expected_from_jsonl
from tiny_run import train

import distml
from distml.config import RunConfig
from distml.telemetry.metrics_stream import round_scalars, step_scalars, write_metrics
from distml.telemetry.mlflow_log import MlflowTarget, flat_params, log_run, target_for

# Importing mlflow starts a process (``uname -p``, for its platform record): these tests are
# out of the in-process loop, and import it in a fixture, not at collection (it is slow).
pytestmark = pytest.mark.distributed


@pytest.fixture(autouse=True)
def _mlflow_installed() -> None:
    pytest.importorskip("mlflow.tracking", reason="pip install 'distml[mlflow]'")


RECORD = {"step": 0, "rank": 0, "loss": 2.0, "samples": 8, "step_s": 0.5, "compute_s": 0.4,
          "comm_s": 0.1, "sync_wait_s": 0.0, "energy_j": 1.0, "peak_mem_bytes": 10,
          "comm_bytes": {"all_reduce": 64}, "wire_bytes": {"all_reduce": 64}}  # fmt: skip


def logged(uri: str, experiment: str = "distml") -> tuple[object, dict[str, list]]:
    """The one run of ``experiment`` at ``uri`` and its metrics, by key, as (step, value)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    history = {
        key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        for key in run.data.metrics
    }
    return run, history


def test_a_training_run_is_logged_as_its_event_files_are(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    distml.launch(train, nproc=2, runs_dir=tmp_path, run_name="tracked",
                  telemetry={"progress": False, "mlflow_uri": uri})  # fmt: skip
    folder = tmp_path / "tracked"
    lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((folder / "summary.json").read_text())
    run, history = logged(uri)
    expected = expected_from_jsonl(lines, summary["eval"])
    assert sorted(history) == sorted(expected)
    for key, series in expected.items():
        assert [s for s, _ in history[key]] == [s for s, _ in sorted(series)], key
        for (_, value), (_, want) in zip(history[key], sorted(series), strict=True):
            assert value == pytest.approx(want, rel=1e-12), key
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    params = run.data.params
    assert params["strategy.name"] == "ddp" and params["nproc"] == "2"
    assert not any("mlflow_uri" in key for key in params)  # a URI may carry credentials
    assert run.data.tags["distml.kind"] == "train" and run.data.tags["distml.attempt"] == "0"


def test_a_local_file_store_takes_the_run(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps it behind a switch
    uri = (tmp_path / "mlruns").as_uri()
    target = MlflowTarget(uri, "files", "one", {"strategy": {"name": "ddp", "x": None}})
    records = [[RECORD, {**RECORD, "step": 1, "loss": 1.5}]]
    write_metrics(tmp_path / "run", records, {"accuracy": 0.75}, mlflow=target)
    run, history = logged(uri, "files")
    assert history["loss"] == [(0, 2.0), (1, 1.5)]
    assert history["rank0/comm_bytes/all_reduce"] == [(0, 64.0), (1, 64.0)]
    assert history["eval/accuracy"] == [(1, 0.75)]
    assert run.data.params == {"strategy.name": "ddp"}


def test_parameters_flatten_and_long_values_are_cut() -> None:
    settings = {"a": {"b": {"c": 1}}, "d": None, "e": "x" * 7000}
    assert dict(flat_params(settings)) == {"a.b.c": "1", "e": "x" * 6000}
    cfg = RunConfig(telemetry={"mlflow_uri": "http://user:secret@tracking:5000"})
    target = target_for(cfg, attempt=2)
    assert target is not None and target.tags["distml.attempt"] == "2"
    assert "secret" not in json.dumps(dict(flat_params(target.params)))
    assert target_for(RunConfig()) is None


def test_a_store_that_cannot_be_reached_costs_a_warning(monkeypatch, caplog) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    target = MlflowTarget("http://user:secret@127.0.0.1:9", "distml", "lost")  # discard port
    with caplog.at_level(logging.WARNING, logger="distml.telemetry"):
        assert log_run(target, step_scalars([[RECORD]])) is None
    assert "was not logged" in caplog.text and "secret" not in caplog.text


def test_without_mlflow_the_run_says_how_to_install_it(monkeypatch, caplog) -> None:
    for name in [n for n in sys.modules if n == "mlflow" or n.startswith("mlflow.")]:
        monkeypatch.setitem(sys.modules, name, None)  # importing it raises ImportError
    with caplog.at_level(logging.WARNING, logger="distml.telemetry"):
        assert log_run(MlflowTarget("sqlite:///x.db", "e", "r"), []) is None
    assert "pip install 'distml[mlflow]'" in caplog.text


def test_a_federated_simulation_logs_its_rounds(tmp_path: Path) -> None:
    """``distml fl simulate --mlflow-uri``: each round's figures at the round's number, as the
    event files have them, and the simulation's settings."""
    from typer.testing import CliRunner

    from distml.cli.main import app

    uri, out = f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "federated"
    argv = ["fl", "simulate", "--clients", "4", "--rounds", "2", "--processes", "1",
            "--out", str(out), "--mlflow-uri", uri, "--json"]  # fmt: skip
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output
    run, history = logged(uri)
    expected: dict[str, list] = {}
    for tag, value, step in round_scalars(json.loads((out / "history.json").read_text())):
        expected.setdefault(tag, []).append((step, pytest.approx(value, rel=1e-12)))
    assert history == expected and [s for s, _ in history["accuracy"]] == [1, 2]
    assert run.info.run_name == "federated" and run.data.tags["distml.kind"] == "federated"
    assert run.data.params["strategy"] == "fedavg" and run.data.params["clients"] == "4"


def test_a_study_logs_its_trials_and_best_parameters(tmp_path: Path) -> None:
    """``distml tune --mlflow-uri``: the trials' values and the best so far at each trial's
    number, their reports, the best parameters; not the storage URL, which may hold a
    password."""
    import optuna

    from distml.tune import tune

    objective = f"{Path(__file__).resolve().parents[1] / 'tune' / 'objectives.py'}:staircase"
    uri, storage = f"sqlite:///{tmp_path / 'mlflow.db'}", f"sqlite:///{tmp_path / 'study.db'}"
    result = tune(objective, n_trials=3, workers=1, storage=storage, seed=1, pruner="none",
                  runs_dir=None, mlflow_uri=uri, mlflow_experiment="tuning")  # fmt: skip
    run, history = logged(uri, "tuning")
    trials = optuna.load_study(study_name=result.study_name, storage=storage).get_trials()
    assert history["value"] == [(t.number, pytest.approx(t.value)) for t in trials]
    assert history["trial0/reported"] == sorted(trials[0].intermediate_values.items())
    assert run.data.params["best.x"] == str(result.best_params["x"])
    assert run.data.params["n_trials"] == "3" and "storage" not in run.data.params
    assert run.info.run_name == result.study_name and run.data.tags["distml.kind"] == "tune"
