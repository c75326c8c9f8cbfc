"""Exactly ``n_trials`` finished trials (COMPLETE or PRUNED), however many workers share a study.

A worker stops once the study has ``n_trials`` finished trials, which is what makes a resumed
job run only what is missing. That alone (all Optuna's ``MaxTrialsCallback`` does) overshoots:
each worker checks after its own trial, so W workers near the end can each start one more. Two
rules, both read from the database so that they hold across hosts and restarts, close the gap:

- Between trials a worker starts another only if a place is free: finished + running trials
  < ``n_trials``, or a queued (WAITING) trial is there to take, which Optuna hands out before
  sampling a new one. Otherwise it waits, since a running trial may still fail and free its
  place, and it stops when the study is full.
- Two workers may pass that check in the same instant. So a trial, as it starts, counts the
  finished trials and the running or queued ones numbered below it; if they hold every place,
  it is surplus: it fails at once, before sampling anything, with the user attribute
  ``surplus``, and is not counted as a failure.

A trial left RUNNING by a dead worker holds its place until its heartbeat goes stale; it is then
failed and its retry queued under a new, higher number, which takes over that place: every
trial started meanwhile counted the stale one as running and left room for it; from its failure
until its retry is queued, it still counts (``liveness.awaiting_retry``). While waiting,
a worker fails dead workers' trials itself (see ``liveness``), since Optuna does so only when a
trial starts.
"""

from __future__ import annotations

import time

import optuna
from optuna.trial import FrozenTrial, TrialState

from distml.tune.liveness import awaiting_retry, fail_dead_trials

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)
HELD = (TrialState.RUNNING, TrialState.WAITING)
SURPLUS = "surplus"
POLL_S = 0.25


class BudgetSpent(Exception):
    """The study already has its trials: this one is surplus and must not run."""


def is_failure(trial: FrozenTrial) -> bool:
    """FAIL, and not a surplus trial stopped before it began."""
    return trial.state == TrialState.FAIL and not trial.user_attrs.get(SURPLUS)


def wait_for_room(study: optuna.Study, n_trials: int, grace_s: float) -> bool:
    """Block until this worker may start a trial (True) or the study needs no more (False).

    The study needs no more once it has ``n_trials`` finished trials, or ``n_trials`` failed
    ones, so that an objective that always raises does not loop forever. ``grace_s``: how long
    a trial may go without a heartbeat before it counts as dead.
    """
    while True:
        trials = study.get_trials(deepcopy=False)
        finished = sum(t.state in FINISHED for t in trials)
        if finished >= n_trials or sum(map(is_failure, trials)) >= n_trials:
            return False
        running = sum(t.state == TrialState.RUNNING for t in trials)
        running += awaiting_retry(trials, grace_s)
        if finished + running < n_trials or any(t.state == TrialState.WAITING for t in trials):
            return True
        fail_dead_trials(study, grace_s)
        time.sleep(POLL_S)


def gate(trial: optuna.Trial, n_trials: int, grace_s: float) -> None:
    """Raise BudgetSpent if ``trial`` would be one more than the study needs. It never waits,
    so no trial can hold a worker that another trial waits for."""
    trials = trial.study.get_trials(deepcopy=False)
    finished = sum(t.state in FINISHED for t in trials)
    ahead = sum(t.state in HELD and t.number < trial.number for t in trials)
    ahead += awaiting_retry(trials, grace_s)
    if finished + ahead >= n_trials:
        trial.set_user_attr(SURPLUS, True)
        raise BudgetSpent(f"trial {trial.number} is not needed: the study has its trials")


class BudgetCallback:
    """After each trial: wait until a place is free, or stop this worker once the study needs
    no more trials, which covers what Optuna's ``MaxTrialsCallback`` would stop at."""

    def __init__(self, n_trials: int, grace_s: float):
        self.n_trials = n_trials
        self.grace_s = grace_s

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        if not wait_for_room(study, self.n_trials, self.grace_s):
            study.stop()
