"""Objectives with known answers for the tuning tests; workers import them by file path."""

from __future__ import annotations

import os
import time

import optuna
from optuna.trial import TrialState

OPTIMUM = 2.0
STEPS = 5
HOLD_ENV = "DISTML_TEST_HOLD"  # a file: while it exists, held_quadratic's later trials wait


def _until(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)


def quadratic(trial: optuna.Trial) -> float:
    """(x - 2)^2 on [-10, 10]: the minimum is 0, at x = 2.

    Trials 0 and 1 wait (up to a minute) until two trials run at once: the first worker to start
    cannot take trial 1 while it runs trial 0, so each worker surely runs a trial, in parallel.
    """
    x = trial.suggest_float("x", -10.0, 10.0)
    if trial.number < 2:
        study = trial.study
        _until(lambda: len(study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))) >= 2, 60)
    time.sleep(0.05)
    return (x - OPTIMUM) ** 2


def held_quadratic(trial: optuna.Trial) -> float:
    """The quadratic at 0.2 s a trial; while the file named by $DISTML_TEST_HOLD exists, trials
    numbered 3 and up wait, so that a job is surely mid-run when the test kills it."""
    x = trial.suggest_float("x", -10.0, 10.0)
    hold = os.environ.get(HOLD_ENV)
    if hold and trial.number >= 3:
        _until(lambda: not os.path.exists(hold), 120)
    time.sleep(0.2)
    return (x - OPTIMUM) ** 2


def staircase(trial: optuna.Trial) -> float:
    """Reports x * (step + 1) at each of 5 steps: a trial's curve is worse than the median curve
    exactly when its x is, so the median pruner stops some trials early."""
    x = trial.suggest_float("x", 0.0, 1.0)
    for step in range(STEPS):
        trial.report(x * (step + 1), step)
        if trial.should_prune():
            raise optuna.TrialPruned()
        time.sleep(0.01)
    return x * STEPS
