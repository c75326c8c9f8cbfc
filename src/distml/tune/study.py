"""What a study keeps about itself in the database, and what a finished job reports.

The job that creates a study writes its trial budget and pruner into the study's user
attributes, so a worker started later on another host (``distml tune worker``) runs the same
job from the URL and the study name alone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import optuna
from optuna.trial import TrialState

from distml.config import ConfigError
from distml.telemetry.metrics_stream import Scalar
from distml.tune.budget import is_failure
from distml.tune.config import TuneConfig

N_TRIALS = "distml.n_trials"
PRUNER = "distml.pruner"


@dataclass(frozen=True)
class StudySettings:
    n_trials: int
    pruner: str


def prepare_study(config: TuneConfig, storage: optuna.storages.BaseStorage) -> optuna.Study:
    """Create the study, or load it to resume; its budget and pruner become ``config``'s.

    A larger ``n_trials`` than last time extends a finished study; a different direction is
    refused, since the trials already in it were judged by the other one.
    """
    study = optuna.create_study(
        storage=storage,
        study_name=config.study_name,
        direction=config.direction,
        load_if_exists=True,
    )
    direction = study.direction.name.lower()
    if direction != config.direction:
        raise ConfigError(
            f"study {config.study_name!r} already exists to {direction}, not {config.direction}; "
            "choose another --study"
        )
    study.set_user_attr(N_TRIALS, config.n_trials)
    study.set_user_attr(PRUNER, config.pruner)
    return study


def read_settings(storage: optuna.storages.BaseStorage, study_name: str) -> StudySettings:
    """The budget and pruner that the job which created ``study_name`` stored."""
    try:
        study_id = storage.get_study_id_from_name(study_name)
    except KeyError:
        raise ConfigError(
            f"no study {study_name!r} in this storage: start the job first "
            f"(distml tune OBJECTIVE --study {study_name} --storage URL)"
        ) from None
    attrs = storage.get_study_user_attrs(study_id)
    if N_TRIALS not in attrs:
        raise ConfigError(f"study {study_name!r} was not created by distml tune: it has no budget")
    return StudySettings(n_trials=int(attrs[N_TRIALS]), pruner=str(attrs.get(PRUNER, "median")))


@dataclass(frozen=True)
class TuneResult:
    """How a tuning job ended. ``failed`` counts trials that raised or whose worker died."""

    study_name: str
    direction: str
    n_trials: int
    complete: int
    pruned: int
    failed: int
    best_value: float | None
    best_trial: int | None
    best_params: dict[str, Any] = field(default_factory=dict)

    @property
    def finished(self) -> int:
        return self.complete + self.pruned

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"finished": self.finished}


def study_scalars(study: optuna.Study) -> list[Scalar]:
    """A study as TensorBoard scalars: each finished trial's reports (``trial<N>/reported`` at
    its steps), and at each trial's number its final ``value`` and the study's ``best_value``
    so far (pruned trials have reports, no value)."""
    maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE
    better = max if maximize else min
    out: list[Scalar] = []
    best: float | None = None
    for trial in sorted(study.get_trials(deepcopy=False), key=lambda t: t.number):
        if trial.state not in (TrialState.COMPLETE, TrialState.PRUNED):
            continue
        tag = f"trial{trial.number}/reported"
        out += [(tag, float(v), step) for step, v in sorted(trial.intermediate_values.items())]
        if trial.state == TrialState.COMPLETE and trial.value is not None:
            best = trial.value if best is None else better(best, trial.value)
            out += [("value", float(trial.value), trial.number)]
            out += [("best_value", float(best), trial.number)]
    return out


def summarize(study: optuna.Study, n_trials: int) -> TuneResult:
    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    best = study.best_trial if complete else None
    return TuneResult(
        study_name=study.study_name,
        direction=study.direction.name.lower(),
        n_trials=n_trials,
        complete=len(complete),
        pruned=sum(t.state == TrialState.PRUNED for t in trials),
        failed=sum(map(is_failure, trials)),
        best_value=None if best is None else best.value,
        best_trial=None if best is None else best.number,
        best_params={} if best is None else dict(best.params),
    )
