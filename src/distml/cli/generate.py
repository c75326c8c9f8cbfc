"""``distml generate``: greedy text generation with a GPT sharded over worker processes."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from distml.cli.messages import err, fail_usage, report_failure
from distml.config import ConfigError, parse_mesh


def generate(
    checkpoint: Annotated[
        Path, typer.Argument(help="A run folder, a checkpoint folder or a .safetensors file.")
    ],
    prompt: Annotated[str, typer.Option(help="The text to continue.")] = "def ",
    tokens: Annotated[int, typer.Option(help="How many tokens (bytes) to generate.")] = 64,
    nproc: Annotated[int, typer.Option(help="Worker processes.")] = 1,
    mesh: Annotated[str | None, typer.Option(help="Layout, e.g. tp=2 or pp=2.")] = None,
) -> None:
    """Continue PROMPT with the GPT exported by a run, laid out over NPROC processes."""
    from distml.jobs.generate import generate_text
    from distml.launch.elastic import LaunchError

    if tokens < 1:
        fail_usage(f"--tokens must be >= 1, got {tokens}")
    if not prompt:
        fail_usage("--prompt must not be empty")
    try:
        layout = parse_mesh(mesh) if mesh is not None else None
        text = generate_text(checkpoint, prompt, tokens, nproc=nproc, mesh=layout)
    except ConfigError as exc:
        fail_usage(str(exc))
    except LaunchError as exc:
        report_failure("distml generate failed", exc)
    err.print(f"[dim]{nproc} process(es), mesh {mesh or 'none'}[/]", highlight=False)
    print(text)
