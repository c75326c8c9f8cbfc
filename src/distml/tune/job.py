"""A tuning job on this machine: create or resume the study, run local workers, report.

Each local worker is a subprocess running ``distml tune worker``: the very command that joins
the study from another host, so the path tested here is the one used across machines. A
subprocess rather than a ``multiprocessing`` (spawn) process, because spawn re-imports the
caller's ``__main__`` in every child: ``tune()`` would then fail when called from a script
without an ``if __name__ == "__main__"`` guard, from stdin or from a notebook. Like spawn, each
worker starts clean, with no threads, locks or database connections copied from the parent (as
``fork`` would), and it imports the objective from its import path, never from a pickle. The
price is about a second of imports per worker, in parallel, against trials of seconds.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from sqlalchemy.exc import SQLAlchemyError

from distml.telemetry.metrics_stream import write_events
from distml.tune.config import TuneConfig, build_tune_config
from distml.tune.objective import Objective, load_objective, objective_spec
from distml.tune.storage import DEFAULT_STORAGE, HEARTBEAT_S, open_storage
from distml.tune.study import TuneResult, prepare_study, study_scalars, summarize


class TuneError(RuntimeError):
    """The job ended without its trials: the message says how far it got and why."""


def tune(
    objective: str | Objective,
    *,
    n_trials: int,
    workers: int = 2,
    storage: str = DEFAULT_STORAGE,
    study_name: str | None = None,
    direction: str = "minimize",
    pruner: str = "median",
    seed: int | None = None,
    heartbeat_s: int = HEARTBEAT_S,
    runs_dir: Path | str | None = "runs",
    mlflow_uri: str | None = None,
    mlflow_experiment: str = "distml",
) -> TuneResult:
    """Tune ``objective`` until its study has ``n_trials`` finished (complete or pruned) trials,
    in ``workers`` local processes; a study already in ``storage`` is resumed, not restarted.

    ``objective(trial) -> float`` is a module-level function or an import path
    (``package.module:function``, ``path/to/file.py:function``). ``pruner``: ``median``,
    ``median:startup=N,warmup=N,interval=N`` or ``none``. Worker i's sampler is seeded with
    ``seed + i``. Workers on other hosts join with :func:`distml.tune.run_worker` (``distml tune
    worker``) on the same storage URL and study name. Bad settings raise ``ConfigError`` before
    anything starts; a job that could not finish raises ``TuneError``. The study's trials go
    to TensorBoard event files in ``runs_dir/<study>/tb/`` (None: nowhere) and, with
    ``mlflow_uri``, to one MLflow run named after the study.

    >>> result = tune("examples/digits/tune.py:objective", n_trials=8, workers=2,
    ...               direction="maximize", storage="sqlite:///digits.db")  # doctest: +SKIP
    >>> result.finished, sorted(result.best_params)  # doctest: +SKIP
    (8, ['hidden', 'lr', 'momentum'])
    """
    config = build_tune_config(
        objective=objective_spec(objective),
        n_trials=n_trials,
        workers=workers,
        storage=storage,
        study_name=study_name,
        direction=direction,
        pruner=pruner,
        seed=seed,
        heartbeat_s=heartbeat_s,
    )
    load_objective(config.objective)  # fail here, once, not in every worker
    try:
        study = prepare_study(config, open_storage(config.storage))
    except SQLAlchemyError as exc:
        raise TuneError(f"cannot open the study in {config.storage}: {exc}") from None
    exit_codes: list[int] = []
    if summarize(study, config.n_trials).finished < config.n_trials:  # else: nothing to resume
        exit_codes = run_local_workers(config)
    result = summarize(study, config.n_trials)
    if runs_dir is not None:
        write_events(Path(runs_dir) / run_folder(result.study_name) / "tb", study_scalars(study))
    if mlflow_uri is not None:
        _log_study(mlflow_uri, mlflow_experiment, config, result, study_scalars(study))
    if result.finished < config.n_trials:
        raise TuneError(_unfinished(result, exit_codes))
    return result


def _log_study(
    uri: str, experiment: str, config: TuneConfig, result: TuneResult, scalars: list
) -> None:
    """The study as one MLflow run: its settings (not the storage URL, which may carry a
    password), the best trial's parameters as ``best.<name>``, and the trials' scalars."""
    from distml.telemetry.mlflow_log import MlflowTarget, log_run

    settings = config.model_dump(exclude={"storage"})
    settings |= {f"best.{name}": value for name, value in result.best_params.items()}
    log_run(MlflowTarget(uri, experiment, result.study_name, settings, {"distml.kind": "tune"}),
            scalars)  # fmt: skip


def run_folder(study_name: str) -> str:
    """A study's folder name under ``runs/``: its name, with what a path cannot hold replaced
    (the default name is the objective as written, ``examples/digits/tune.py:objective``)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", study_name).strip("._") or "study"


def _unfinished(result: TuneResult, exit_codes: list[int]) -> str:
    why = [f"worker {i} exited with code {code}" for i, code in enumerate(exit_codes) if code]
    if result.failed >= result.n_trials:
        why.append(f"{result.failed} trials failed (the log above says why)")
    return (
        f"{result.finished} of {result.n_trials} trials finished in study "
        f"{result.study_name!r}: {'; '.join(why) or 'workers stopped early'}. "
        "Run the same command again to resume."
    )


def worker_command(config: TuneConfig, index: int) -> list[str]:
    """The command line of local worker ``index``: ``distml tune worker``, as on any host."""
    argv = [sys.executable, "-m", "distml.cli.tune", "worker", config.objective]
    argv += ["--storage", config.storage, "--study", config.study_name]
    argv += ["--heartbeat", str(config.heartbeat_s)]
    if config.seed is not None:
        argv += ["--seed", str(config.seed + index)]
    return argv


def run_local_workers(config: TuneConfig) -> list[int]:
    """Run ``config.workers`` worker processes to the end; their exit codes, by worker index.

    If this process is interrupted, the workers are terminated; their running trials stay
    RUNNING in the database until their heartbeat goes stale, then are failed and retried.
    """
    # Workers import what this process can: its sys.path, as multiprocessing's spawn passes on.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    # stdout=2: the job's stdout carries its result alone (--json); the workers' goes to stderr.
    procs = [
        subprocess.Popen(worker_command(config, i), env=env, stdout=2)
        for i in range(config.workers)
    ]
    try:
        return [proc.wait() for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
