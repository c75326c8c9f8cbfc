"""How the trials of a dead worker free their places.

Optuna fails a RUNNING trial whose heartbeat is older than the grace period, and queues its
retry, but only once the trial has a heartbeat at all: a worker killed between creating a trial
and its heartbeat thread's first write leaves the trial RUNNING for ever, and a job that waits
for its running trials would never end. So a worker writes the first heartbeat itself as a
trial starts, then marks the trial as its own; a RUNNING trial without that mark after the
grace period was never started, holds no parameters, and is failed outright.
"""

from __future__ import annotations

import logging
import os
import socket
import warnings
from datetime import datetime, timedelta

import optuna
from optuna.trial import TrialState

WORKER = "worker"  # user attribute: {"host", "pid", "trial"} of the run that started the trial

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
