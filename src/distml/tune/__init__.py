"""Distributed hyperparameter tuning with Optuna: trials in parallel worker processes on one
host or many, the study in a database (SQLite by default, PostgreSQL across hosts), so that a
killed job resumes where it stopped.

    from distml.tune import tune
    result = tune("examples/digits/tune.py:objective", n_trials=20, workers=2,
                  direction="maximize")
    print(result.best_value, result.best_params)
"""

from distml.tune.config import TuneConfig, build_tune_config, parse_pruner
from distml.tune.job import TuneError, run_local_workers, tune
from distml.tune.objective import load_objective, objective_spec
from distml.tune.storage import DEFAULT_STORAGE, check_storage_url, open_storage
from distml.tune.study import TuneResult
from distml.tune.worker import run_worker

__all__ = [
    "DEFAULT_STORAGE",
    "TuneConfig",
    "TuneError",
    "TuneResult",
    "build_tune_config",
    "check_storage_url",
    "load_objective",
    "objective_spec",
    "open_storage",
    "parse_pruner",
    "run_local_workers",
    "run_worker",
    "tune",
]
