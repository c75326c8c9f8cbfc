"""The settings of a tuning job, validated once, before any worker starts."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import optuna
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from distml.config import ConfigError, format_validation_error, parse_options
from distml.tune.storage import DEFAULT_STORAGE, HEARTBEAT_S, check_storage_url

# Short names on the command line for MedianPruner's arguments.
_MEDIAN_OPTIONS = {
    "startup": "n_startup_trials",
    "warmup": "n_warmup_steps",
    "interval": "interval_steps",
}
PRUNER_HELP = "median[:startup=N,warmup=N,interval=N] or none"


def parse_pruner(spec: str) -> optuna.pruners.BasePruner:
    """``median`` (Optuna's MedianPruner), ``median:startup=2,warmup=1`` or ``none``.

    A trial is pruned at step s when its intermediate value there is worse than the median of
    the earlier trials' values at s, once ``startup`` trials have finished and after ``warmup``
    steps of its own.

    >>> type(parse_pruner("median:startup=2")).__name__
    'MedianPruner'
    """
    name, _, options = spec.partition(":")
    if name == "none" and not options:
        return optuna.pruners.NopPruner()
    if name != "median":
        raise ConfigError(f"pruner {spec!r}: use {PRUNER_HELP}")
    kwargs: dict[str, int] = {}
    for key, value in parse_options(options, f"pruner {spec!r}").items():
        if key not in _MEDIAN_OPTIONS:
            raise ConfigError(f"pruner {spec!r}: unknown option {key!r}; use {PRUNER_HELP}")
        try:
            kwargs[_MEDIAN_OPTIONS[key]] = int(str(value))
        except ValueError:
            raise ConfigError(f"pruner {spec!r}: {key} must be an integer") from None
    try:
        return optuna.pruners.MedianPruner(**kwargs)
    except ValueError as exc:
        raise ConfigError(f"pruner {spec!r}: {exc}") from None


class TuneConfig(BaseModel):
    """One tuning job. ``study_name`` defaults to the objective's import path, so that running
    the same command again finds the same study."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    objective: str
    n_trials: Annotated[int, Field(ge=1)]
    workers: Annotated[int, Field(ge=1)] = 2
    storage: str = DEFAULT_STORAGE
    study_name: Annotated[str, Field(min_length=1)]
    direction: Literal["minimize", "maximize"] = "minimize"
    pruner: str = "median"
    seed: int | None = None
    heartbeat_s: Annotated[int, Field(ge=1)] = HEARTBEAT_S

    @model_validator(mode="before")
    @classmethod
    def _name_after_objective(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("study_name") is None:
            data = {**data, "study_name": data.get("objective")}
        return data

    @field_validator("storage")
    @classmethod
    def _storage_opens(cls, url: str) -> str:
        return check_storage_url(url)

    @field_validator("pruner")
    @classmethod
    def _pruner_parses(cls, spec: str) -> str:
        parse_pruner(spec)
        return spec


def build_tune_config(**fields: Any) -> TuneConfig:
    """Validate settings into a TuneConfig, turning pydantic's report into one ConfigError.

    >>> build_tune_config(objective="m:f", n_trials=10).study_name
    'm:f'
    """
    try:
        return TuneConfig(**fields)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None
