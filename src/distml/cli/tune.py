"""``distml tune``: hyperparameter search with Optuna, trials in parallel worker processes, the
study in a database so that a killed job resumes where it stopped.

    distml tune examples/digits/tune.py:objective --trials 40 --workers 2 --direction maximize
    distml tune worker examples/digits/tune.py:objective --storage URL --study NAME  # other hosts
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from distml.cli.default_command import group_with_default
from distml.cli.messages import fail_usage, report_failure
from distml.cli.options import MlflowExperiment, MlflowUri

START = "start"

tune_app = typer.Typer(
    cls=group_with_default(START),  # distml tune OBJECTIVE = distml tune start OBJECTIVE
    help="Tune hyperparameters with Optuna: parallel trials, pruning, a study that resumes.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

ObjectiveArg = Annotated[
    str, typer.Argument(help="MODULE:FUNCTION or FILE.py:FUNCTION; objective(trial) -> float.")
]
Storage = Annotated[
    str, typer.Option(help="Database URL: sqlite:///FILE or postgresql+psycopg://USER@HOST/DB.")
]
Study = Annotated[
    str | None, typer.Option("--study", help="Study name; default: the OBJECTIVE as written.")
]
Heartbeat = Annotated[
    int,
    typer.Option(help="Seconds between a trial's heartbeats; silent for 3: failed and retried."),
]


def _interrupt(signum: int, frame: object) -> NoReturn:
    raise KeyboardInterrupt


@tune_app.command(name=START)
def start(
    objective: ObjectiveArg,
    trials: Annotated[int, typer.Option("--trials", help="Finished trials the study needs.")],
    workers: Annotated[int, typer.Option(help="Worker processes on this host.")] = 2,
    storage: Storage = "sqlite:///study.db",
    study: Study = None,
    direction: Annotated[str, typer.Option(help="minimize or maximize.")] = "minimize",
    pruner: Annotated[
        str, typer.Option(help="median[:startup=N,warmup=N,interval=N] or none.")
    ] = "median",
    seed: Annotated[int | None, typer.Option(help="Sampler seed; worker i gets SEED + i.")] = None,
    heartbeat: Heartbeat = 10,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    runs_dir: Annotated[
        Path, typer.Option("--runs-dir", help="TensorBoard event files go to RUNS_DIR/<study>/tb/.")
    ] = Path("runs"),
    mlflow_uri: MlflowUri = None,
    mlflow_experiment: MlflowExperiment = "distml",
) -> None:
    """Run OBJECTIVE's trials in local worker processes until the study has TRIALS finished.

    Run the same command again to resume a killed job, or with more --trials to extend a study.
    """
    from distml.config import ConfigError
    from distml.tune import TuneError, tune

    # `kill JOB` then unwinds like Ctrl-C, through the code that stops the workers.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        result = tune(
            objective,
            n_trials=trials,
            workers=workers,
            storage=storage,
            study_name=study,
            direction=direction,
            pruner=pruner,
            seed=seed,
            heartbeat_s=heartbeat,
            runs_dir=runs_dir,
            mlflow_uri=mlflow_uri,
            mlflow_experiment=mlflow_experiment,
        )
    except ConfigError as exc:
        fail_usage(str(exc))
    except TuneError as exc:
        report_failure("distml tune failed", exc)
    if as_json:
        print(json.dumps(result.to_dict()))
        return
    print(
        f"study {result.study_name!r}: {result.finished} of {result.n_trials} trials finished "
        f"({result.complete} complete, {result.pruned} pruned), {result.failed} failed"
    )
    if result.best_trial is not None:
        print(f"best value {result.best_value:.6g} (trial {result.best_trial})")
        for name, value in result.best_params.items():
            print(f"  {name} = {value}")


@tune_app.command()
def worker(
    objective: ObjectiveArg,
    storage: Storage = "sqlite:///study.db",
    study: Study = None,
    seed: Annotated[int | None, typer.Option(help="This worker's sampler seed.")] = None,
    heartbeat: Heartbeat = 10,
) -> None:
    """Join a study started by distml tune, from any host that reaches its database.

    Runs the study's trials until it has as many finished as the job asked for.
    """
    from sqlalchemy.exc import SQLAlchemyError

    from distml.config import ConfigError
    from distml.tune import run_worker

    try:
        ran = run_worker(objective, storage, study or objective, seed=seed, heartbeat_s=heartbeat)
    except ConfigError as exc:
        fail_usage(str(exc))
    except SQLAlchemyError as exc:
        report_failure("distml tune worker failed", exc)
    print(f"this worker ran {ran} trial(s)")


if __name__ == "__main__":  # python -m distml.cli.tune ...
    tune_app()
