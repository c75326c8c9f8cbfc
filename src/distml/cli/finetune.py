"""``distml finetune``: fine-tune a trained model in worker processes (a new head, frozen
modules, LoRA adapters), starting from any run's checkpoint or export."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from distml.cli.data_spec import DATA_HELP
from distml.cli.messages import err, fail_usage, report_failure


def finetune(
    base: Annotated[
        Path, typer.Argument(help="A run folder, a checkpoint folder or a .safetensors file.")
    ],
    data: Annotated[str, typer.Option(help="Training data: " + DATA_HELP)] = "digits",
    val: Annotated[str | None, typer.Option(help="Held-out data, in the same forms.")] = None,
    model: Annotated[str, typer.Option(help="digits-mlp, digits-cnn or gpt.")] = "digits-cnn",
    head: Annotated[
        int | None, typer.Option(help="Replace the head by one with this many outputs.")
    ] = None,
    head_module: Annotated[
        str | None, typer.Option(help="The head's module name (default: the last Linear).")
    ] = None,
    freeze: Annotated[
        list[str] | None, typer.Option(help="Freeze the modules a pattern names (repeatable).")
    ] = None,
    lora: Annotated[int | None, typer.Option(help="Train LoRA adapters of rank R.")] = None,
    lora_alpha: Annotated[float | None, typer.Option(help="LoRA alpha (default: R).")] = None,
    lora_target: Annotated[
        list[str] | None,
        typer.Option(help="Linear modules to adapt, as patterns (repeatable; default: all)."),
    ] = None,
    epochs: Annotated[int, typer.Option(help="Passes over the training data.")] = 1,
    steps: Annotated[int, typer.Option(help="Stop after this many steps (0: epochs).")] = 0,
    global_batch: Annotated[
        int, typer.Option(help="Samples per step, split over the data-parallel ranks.")
    ] = 32,
    lr: Annotated[float, typer.Option(help="SGD learning rate (momentum 0.9).")] = 0.05,
    nproc: Annotated[int, typer.Option(help="Worker processes.")] = 2,
    mesh: Annotated[str | None, typer.Option(help="Layout, e.g. dp=2 or pp=2.")] = None,
    run_name: Annotated[str | None, typer.Option(help="Folder name under runs/.")] = None,
    runs_dir: Annotated[Path | None, typer.Option(help="Where run folders go.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the new head and the adapters.")] = 0,
) -> None:
    """Fine-tune the model at BASE on DATA: a new head, frozen modules or LoRA adapters.

    Writes a run folder; with LoRA, adapter.safetensors beside the merged model.safetensors.
    """
    from pydantic import ValidationError

    from distml.cli.data_spec import parse_data
    from distml.config import ConfigError, format_validation_error, parse_mesh
    from distml.jobs.finetune import FineTuneSpec, run_finetune, with_gpt_size
    from distml.launch.elastic import LaunchError

    settings = {"run_name": run_name, "runs_dir": runs_dir}
    try:
        spec = FineTuneSpec(
            model=model,
            base=base,
            head=head,
            head_module=head_module,
            freeze=freeze or [],
            lora_r=lora,
            lora_alpha=lora_alpha,
            lora_targets=lora_target or None,
            epochs=epochs,
            steps=steps,
            global_batch=global_batch,
            lr=lr,
            seed=seed,
        )
        spec = with_gpt_size(spec)  # its seq_len cuts the data; run_finetune keeps it
        seq_len = spec.gpt.seq_len if spec.gpt is not None else None
        train = parse_data(data, seq_len=seq_len)
        held_out = parse_data(val, seq_len=seq_len) if val is not None else None
        layout = parse_mesh(mesh) if mesh is not None else None
        summary = run_finetune(
            spec,
            train,
            held_out,
            nproc=nproc,
            mesh=layout,
            **{k: v for k, v in settings.items() if v is not None},
        )
    except ValidationError as exc:
        fail_usage(format_validation_error(exc))
    except ConfigError as exc:
        fail_usage(str(exc))
    except LaunchError as exc:
        report_failure("distml finetune failed", exc)
    err.print(f"run folder: {Path(summary['export']).parent}", highlight=False)
