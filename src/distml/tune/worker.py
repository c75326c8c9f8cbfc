"""One tuning worker: Optuna's ``study.optimize`` on a shared ``RDBStorage``, until the study has
its trials. The same function runs in the job's local worker processes and, through
``distml tune worker``, on any other host pointed at the same database.
"""

from __future__ import annotations

import optuna

from distml.config import ConfigError
from distml.tune.budget import BudgetCallback, gate, wait_for_room
from distml.tune.config import parse_pruner
from distml.tune.liveness import mark_ended, mark_started
from distml.tune.objective import load_objective
from distml.tune.storage import GRACE_FACTOR, HEARTBEAT_S, check_storage_url, open_storage
from distml.tune.study import read_settings


def run_worker(
    objective: str,
    storage: str,
    study_name: str,
    *,
    seed: int | None = None,
    heartbeat_s: int = HEARTBEAT_S,
) -> int:
    """Run trials of ``study_name`` until it has all it needs; returns how many ran here.

    Each trial records the worker's host and pid in its user attribute ``worker``. A trial that
    raises is recorded as FAIL (Optuna logs why, with its parameters) and the worker goes on.

    ``seed`` seeds this worker's TPE sampler: give each worker its own. TPE runs with
    ``constant_liar`` so that workers do not all sample next to the same running trial.
    """
    if heartbeat_s < 1:
        raise ConfigError(f"heartbeat must be >= 1 second, got {heartbeat_s}")
    fn = load_objective(objective)
    rdb = open_storage(check_storage_url(storage), heartbeat_s)
    settings = read_settings(rdb, study_name)
    study = optuna.load_study(
        study_name=study_name,
        storage=rdb,
        sampler=optuna.samplers.TPESampler(seed=seed, constant_liar=True),
        pruner=parse_pruner(settings.pruner),
    )
    grace_s = GRACE_FACTOR * heartbeat_s
    if not wait_for_room(study, settings.n_trials, grace_s):
        return 0  # a resumed study that is already complete
    study_id = rdb.get_study_id_from_name(study_name)
    ran = 0

    def run_trial(trial: optuna.Trial) -> float:
        nonlocal ran
        gate(trial, settings.n_trials, grace_s)
        mark_started(trial, rdb, study_id)
        ran += 1
        try:
            return fn(trial)
        finally:
            mark_ended(trial)

    study.optimize(
        run_trial,
        callbacks=[BudgetCallback(settings.n_trials, grace_s)],
        catch=(Exception,),
        gc_after_trial=False,
    )
    return ran
