"""``distml infer``: predict a whole dataset, or generate from many prompts, in worker
processes; the output file equals that of one process."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from distml.cli.data_spec import DATA_HELP
from distml.cli.messages import err, fail_usage, report_failure

if TYPE_CHECKING:
    from torch import nn


def build_model(name: str, head: int | None, head_module: str | None) -> nn.Module:
    """A registry model, its head replaced as ``distml finetune --head`` replaced it: the
    architecture of a fine-tuned run's export."""
    from distml.models.registry import model_entry
    from distml.train.finetune import last_linear, replace_head

    model = model_entry(name).build()
    if head is not None:
        replace_head(model, head_module or last_linear(model), head)
    return model


def infer(
    checkpoint: Annotated[
        Path, typer.Argument(help="A run folder, a checkpoint folder or a .safetensors file.")
    ],
    out: Annotated[Path, typer.Option(help="The safetensors file to write.")] = Path(
        "predictions.safetensors"
    ),
    data: Annotated[str, typer.Option(help="What to predict: " + DATA_HELP)] = "digits:val",
    model: Annotated[str, typer.Option(help="digits-mlp, digits-cnn or gpt.")] = "digits-cnn",
    head: Annotated[
        int | None, typer.Option(help="A fine-tuned head's outputs (distml finetune --head).")
    ] = None,
    head_module: Annotated[
        str | None, typer.Option(help="The head's module name (default: the last Linear).")
    ] = None,
    prompts: Annotated[
        Path | None, typer.Option(help="--model gpt: a UTF-8 text file, one prompt a line.")
    ] = None,
    tokens: Annotated[int, typer.Option(help="--model gpt: tokens to generate each.")] = 32,
    batch_size: Annotated[int, typer.Option(help="Samples (prompts) per forward pass.")] = 256,
    nproc: Annotated[int, typer.Option(help="Worker processes.")] = 2,
    mesh: Annotated[str | None, typer.Option(help="Layout, e.g. dp=2, tp=2 or pp=2.")] = None,
) -> None:
    """Write the model's outputs for DATA (or the GPT's continuations of PROMPTS) to OUT."""
    from distml.config import ConfigError, parse_mesh
    from distml.launch.elastic import LaunchError
    from distml.models.registry import MODELS

    if model not in MODELS:
        fail_usage(f"unknown --model {model!r}; expected one of {sorted(MODELS)}")
    if batch_size < 1:
        fail_usage(f"--batch-size must be >= 1, got {batch_size}")
    if (model == "gpt") != (prompts is not None):
        fail_usage("--prompts goes with --model gpt, and --model gpt needs --prompts")
    try:
        layout = parse_mesh(mesh) if mesh is not None else None
        settings = {"nproc": nproc, "mesh": layout, "telemetry": {"progress": False}}
        if prompts is not None:
            written = _generate(checkpoint, prompts, tokens, out, batch_size, settings)
        else:
            written = _predict(
                checkpoint, data, out, model, head, head_module, batch_size, settings
            )
    except ConfigError as exc:
        fail_usage(str(exc))
    except LaunchError as exc:
        report_failure("distml infer failed", exc)
    err.print(f"wrote {written}", highlight=False)


def _predict(
    checkpoint: Path,
    data: str,
    out: Path,
    model: str,
    head: int | None,
    head_module: str | None,
    batch_size: int,
    settings: dict,
) -> Path:
    from distml.cli.data_spec import parse_data
    from distml.config import ConfigError
    from distml.jobs.infer import run_inference, splits_model

    if splits_model(settings["mesh"]):
        raise ConfigError(f"{model} is small enough to run whole on each rank: use dp=N")
    build = partial(build_model, model, head, head_module)
    dataset = parse_data(data, targets=False)
    return run_inference(checkpoint, build, dataset, out, batch_size=batch_size, **settings)


def _generate(
    checkpoint: Path, prompts: Path, tokens: int, out: Path, batch_size: int, settings: dict
) -> Path:
    from distml.config import ConfigError
    from distml.jobs.generate import generate_tokens
    from distml.jobs.infer import write_sequences

    if tokens < 1:
        raise ConfigError(f"--tokens must be >= 1, got {tokens}")
    try:
        lines = prompts.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--prompts {str(prompts)!r}: {exc}") from None
    ids = [list(line.encode()) for line in lines]  # an empty line is refused, not skipped:
    # the output's row i answers line i
    sequences = generate_tokens(checkpoint, ids, tokens, batch_size=batch_size, **settings)
    return write_sequences(sequences, out)
