"""``distml tune``: bad input is refused with exit code 2 and one message before anything
starts (no database is created), and ``distml tune OBJECTIVE`` coexists with ``tune worker``."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from distml.cli.tune import tune_app
from distml.config import ConfigError
from distml.tune import build_tune_config, load_objective, objective_spec, open_storage
from distml.tune.study import prepare_study

QUADRATIC = f"{Path(__file__).resolve().parent / 'objectives.py'}:quadratic"


def _root() -> typer.Typer:
    """``tune_app`` mounted the way ``distml`` mounts it."""
    root = typer.Typer()

    @root.command()
    def other() -> None: ...

    root.add_typer(tune_app, name="tune")
    return root


def test_objective_first_means_start():
    runner = CliRunner()
    assert "tune start" in runner.invoke(_root(), ["tune", QUADRATIC, "--help"]).output
    assert "tune worker" in runner.invoke(_root(), ["tune", "worker", "--help"]).output


@pytest.mark.parametrize(
    "args,message",
    [
        (["no_such_module_xyz:objective", "--trials", "3"], "No module named 'no_such_module_xyz'"),
        (["missing/file.py:objective", "--trials", "3"], "no such objective file"),
        ([QUADRATIC.replace(":quadratic", ":nope"), "--trials", "3"], "has no function 'nope'"),
        (["quadratic", "--trials", "3"], "is not MODULE:FUNCTION"),
        ([QUADRATIC, "--trials", "0"], "n_trials: Input should be greater than or equal to 1"),
        ([QUADRATIC, "--trials", "3", "--workers", "0"], "workers"),
        ([QUADRATIC, "--trials", "3", "--storage", "study.db"], "is not a database URL"),
        ([QUADRATIC, "--trials", "3", "--storage", "postgres://h/db"], "unknown database"),
        ([QUADRATIC, "--trials", "3", "--storage", "sqlite:///no/dir/s.db"], "no such directory"),
        ([QUADRATIC, "--trials", "3", "--storage", "sqlite://"], "in-memory SQLite"),
        ([QUADRATIC, "--trials", "3", "--pruner", "mean"], "pruner 'mean'"),
        ([QUADRATIC, "--trials", "3", "--pruner", "median:patience=2"], "unknown option"),
        ([QUADRATIC, "--trials", "3", "--direction", "up"], "'minimize' or 'maximize'"),
        ([QUADRATIC, "--trials", "3", "--heartbeat", "0"], "heartbeat_s"),
        (["worker", QUADRATIC, "--study", "never-started"], "no study 'never-started'"),
        (["worker", "no_such_module_xyz:f"], "No module named 'no_such_module_xyz'"),
    ],
)
def test_bad_input_exits_2_with_one_message_and_starts_nothing(
    args, message, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "study.db"
    if args[0] == "worker" and "--study" in args:
        open_storage(f"sqlite:///{db}")  # a database that holds no such study
    result = CliRunner().invoke(tune_app, args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output
    assert db.exists() == (args[0] == "worker" and "--study" in args)


def test_a_study_is_not_resumed_in_the_other_direction(tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    config = build_tune_config(objective=QUADRATIC, n_trials=2, storage=url, study_name="s")
    prepare_study(config, open_storage(url))
    args = [QUADRATIC, "--trials", "2", "--storage", url, "--study", "s"]
    result = CliRunner().invoke(tune_app, [*args, "--direction", "maximize"])
    assert result.exit_code == 2 and "already exists to minimize" in result.output


def test_an_objective_must_be_importable_by_name():
    with pytest.raises(ConfigError, match="module-level function"):
        objective_spec(lambda trial: 0.0)
    from_file = load_objective(QUADRATIC)  # named by its file again, not by its module
    assert objective_spec(from_file) == f"{Path(QUADRATIC.rpartition(':')[0]).resolve()}:quadratic"
