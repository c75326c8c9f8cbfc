"""How the trials of a dead worker free their places.

Optuna fails a RUNNING trial whose heartbeat is older than the grace period, and queues its
retry, but only once the trial has a heartbeat at all: a worker killed between creating a trial
and its heartbeat thread's first write leaves the trial RUNNING for ever, and a job that waits
for its running trials would never end. So a worker writes the first heartbeat itself as a
trial starts, then marks the trial as its own; a RUNNING trial without that mark after the
grace period was never started, holds no parameters, and is failed outright.

Failing a stale trial and queuing its retry are two writes, by whichever worker noticed: in
between, the trial is neither running nor retried, and another worker would take its place for
a new trial, leaving its retry surplus (its parameters never run). So a trial whose worker died
in it holds its place until its retry is queued: a worker also marks the trial as ended when
the objective returns or raises, and a FAIL trial started but never ended died with its worker.
"""

from __future__ import annotations

import logging
import os
import socket
import warnings
from collections.abc import Sequence
from datetime import datetime, timedelta

import optuna
from optuna.trial import FrozenTrial, TrialState

from distml.tune.storage import MAX_RETRY

WORKER = "worker"  # user attribute: {"host", "pid", "trial"} of the run that started the trial
ENDED = "ended"  # user attribute: the number of the trial whose objective returned or raised
# Optuna's RetryHeartbeatStaleTrialCallback lists, in each retry, the trials it stands for.
RETRY_HISTORY = "retry_history"

log = logging.getLogger(__name__)


def mark_started(trial: optuna.Trial, storage: optuna.storages.RDBStorage, study_id: int) -> None:
    """Record ``trial``'s first heartbeat, then this worker's mark, in that order.

    Optuna's heartbeat thread may be writing the same first heartbeat: ``record_heartbeat``
    ignores the loser's duplicate row, so either way the heartbeat exists once this returns.
    """
    storage.record_heartbeat(
        storage.get_trial_id_from_study_id_trial_number(study_id, trial.number)
    )
    # The trial number tells this run's mark from one a retry copied from the trial it retries.
    mark = {"host": socket.gethostname(), "pid": os.getpid(), "trial": trial.number}
    trial.set_user_attr(WORKER, mark)


def mark_ended(trial: optuna.Trial) -> None:
    """Record that ``trial``'s objective returned or raised: its worker did not die in it."""
    try:
        trial.set_user_attr(ENDED, trial.number)
    except optuna.exceptions.UpdateFinishedTrialError:
        log.warning(
            "trial %d was failed as stale while it ran: its heartbeat came too late "
            "(a longer --heartbeat suits a loaded machine)",
            trial.number,
        )


def died_running(trial: FrozenTrial) -> bool:
    """A trial this worker code started and whose objective never returned nor raised."""
    mark = trial.user_attrs.get(WORKER)
    started = isinstance(mark, dict) and mark.get("trial") == trial.number
    return started and trial.user_attrs.get(ENDED) != trial.number


def awaiting_retry(trials: Sequence[FrozenTrial], grace_s: float) -> int:
    """How many trials were failed for a stale heartbeat and still wait for their retry.

    One whose retry never comes (the worker that failed it died in between) stops waiting
    ``grace_s`` after it was failed, so that no place is held for ever.
    """
    retried = {n for t in trials for n in t.system_attrs.get(RETRY_HISTORY, ())}
    horizon = datetime.now() - timedelta(seconds=grace_s)
    return sum(
        t.state == TrialState.FAIL
        and died_running(t)
        and t.number not in retried
        and len(t.system_attrs.get(RETRY_HISTORY, ())) < MAX_RETRY
        and t.datetime_complete is not None
        and t.datetime_complete > horizon
        for t in trials
    )


def fail_dead_trials(study: optuna.Study, grace_s: float) -> None:
    """Fail the stale trials (and queue their retries), then the never-started ones."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    horizon = datetime.now() - timedelta(seconds=grace_s)
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        mark = trial.user_attrs.get(WORKER)
        started = isinstance(mark, dict) and mark.get("trial") == trial.number
        if not started and trial.datetime_start is not None and trial.datetime_start < horizon:
            log.warning("trial %d never started (its worker died): failing it", trial.number)
            study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)
