"""Options that several commands share, declared once."""

from __future__ import annotations

from typing import Annotated

import typer

MlflowUri = Annotated[
    str | None,
    typer.Option(
        "--mlflow-uri",
        help="Also log to MLflow at this tracking URI (e.g. sqlite:///mlflow.db); credentials "
        "go in MLFLOW_TRACKING_USERNAME/PASSWORD/TOKEN, never in the URI.",
    ),
]
MlflowExperiment = Annotated[str, typer.Option(help="The MLflow experiment to log to.")]
