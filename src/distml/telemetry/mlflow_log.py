"""A run's metrics and settings in MLflow, beside ``metrics.jsonl`` and TensorBoard's ``tb/``.

With ``[telemetry] mlflow_uri`` set (``sqlite:///mlflow.db``, ``http://host:5000``, or any URI
MLflow's client takes), the process that writes the run folder also logs one MLflow run: the
same scalars TensorBoard gets (tag, value, step; see :mod:`distml.telemetry.metrics_stream`),
the run's settings as parameters, and tags for the run folder and the attempt. MLflow is
optional (``pip install 'distml[mlflow]'``). A tracking server that cannot be reached costs the
run nothing but a warning: its files are written first, and they hold the same numbers.

MLflow's own usage telemetry is off in the process that logs (``MLFLOW_DISABLE_TELEMETRY``,
unless the environment sets it). Credentials go where MLflow reads them
(``MLFLOW_TRACKING_USERNAME``/``PASSWORD``/``TOKEN`` in the environment); a URI is never
logged, since it may carry them too.

    mlflow ui --backend-store-uri sqlite:///mlflow.db
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from distml.config import RunConfig

log = logging.getLogger("distml.telemetry")

# MLflow's log_batch limits: 1000 metrics, 100 parameters, and parameter values of 6000 chars.
METRICS_A_BATCH = 1000
PARAMS_A_BATCH = 100
PARAM_CHARS = 6000


@dataclass(frozen=True)
class MlflowTarget:
    """Where and as what a run is logged."""

    uri: str
    experiment: str
    run_name: str
    params: Mapping[str, Any] = field(default_factory=dict)
    tags: Mapping[str, str] = field(default_factory=dict)


def target_for(config: RunConfig, attempt: int = 0, kind: str = "train") -> MlflowTarget | None:
    """Where a run of ``config`` is logged (None without ``telemetry.mlflow_uri``): its name,
    its settings (the planner's record left out: the summary keeps it), and what it was."""
    uri = config.telemetry.mlflow_uri
    if uri is None:
        return None
    settings = config.model_dump(mode="json", exclude={"plan"})
    settings["telemetry"].pop("mlflow_uri")  # it may carry credentials
    tags = {
        "distml.kind": kind,
        "distml.run_dir": str(config.run_dir),
        "distml.attempt": str(attempt),
    }
    return MlflowTarget(uri, config.telemetry.mlflow_experiment, config.run_name, settings, tags)


def flat_params(settings: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    """``{"strategy": {"name": "ddp"}}`` -> ``("strategy.name", "ddp")``; None left out."""
    for key, value in settings.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from flat_params(value, f"{name}.")
        elif value is not None:
            yield name, str(value)[:PARAM_CHARS]


def log_run(target: MlflowTarget, scalars: Iterable[tuple[str, float, int]]) -> str | None:
    """One MLflow run holding ``scalars`` (tag, value, step: what metrics_stream gives
    TensorBoard) and the target's settings; its id, or None (with a warning) where mlflow is
    not installed or the tracking store refused."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # read at mlflow's import
    try:
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient
    except ImportError as exc:
        log.warning("no MLflow run for this run: %s. Install it with: pip install 'distml[mlflow]'",
                    exc)  # fmt: skip
        return None
    now = int(time.time() * 1000)
    metrics = [Metric(tag, float(value), now, int(step)) for tag, value, step in scalars]
    params = [Param(k, v) for k, v in flat_params(target.params)]
    tags = [RunTag(k, v) for k, v in target.tags.items()]
    try:
        client = MlflowClient(tracking_uri=target.uri)
        experiment = client.get_experiment_by_name(target.experiment)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else client.create_experiment(target.experiment)
        )
        run_id = client.create_run(experiment_id, run_name=target.run_name).info.run_id
        for i in range(0, len(params), PARAMS_A_BATCH):
            client.log_batch(run_id, params=params[i : i + PARAMS_A_BATCH])
        for i in range(0, len(metrics), METRICS_A_BATCH):
            client.log_batch(run_id, metrics=metrics[i : i + METRICS_A_BATCH])
        client.log_batch(run_id, tags=tags)
        client.set_terminated(run_id)
    except (MlflowException, OSError) as exc:  # the run's own files hold the same numbers
        log.warning("the MLflow run was not logged (%s): %s", type(exc).__name__, _scrub(exc))
        return None
    return run_id


def _scrub(exc: BaseException) -> str:
    """An error's text without the user:password@ part of any URL in it."""
    return re.sub(r"://[^/\s@]+@", "://***@", str(exc))
