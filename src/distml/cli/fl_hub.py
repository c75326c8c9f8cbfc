"""``distml fl hub``: community contributions. ``serve`` runs a hub that evaluates each submitted
delta on its held-out data and merges the ones that do not cost accuracy; ``contribute``
fine-tunes the hub's latest model on local data and submits the delta; ``versions`` prints the
provenance log."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated

import typer

from distml.cli.data_spec import load_client_data
from distml.cli.messages import fail_usage, report_failure
from distml.cli.tokens import read_tokens

hub_app = typer.Typer(
    help="Community contributions: a hub that evaluates and merges deltas.",
    no_args_is_help=True,
)

HubUrl = Annotated[str, typer.Option("--hub", help="The hub's URL.")]
CaCert = Annotated[str | None, typer.Option(help="CA bundle to verify TLS with.")]


@hub_app.command()
def serve(
    tokens: Annotated[
        Path, typer.Option(help="JSON file {contributor name: token}, readable by you only.")
    ],
    directory: Annotated[
        Path, typer.Option("--dir", help="Versions and the log live here; a restart resumes.")
    ],
    model: Annotated[str, typer.Option(help="digits-mlp or digits-cnn.")] = "digits-mlp",
    seed: Annotated[int, typer.Option(help="Seed of version 0 (without --initial).")] = 0,
    initial: Annotated[
        Path | None, typer.Option(help="Version 0 of a new hub, as safetensors.")
    ] = None,
    held_out: Annotated[
        str | None,
        typer.Option(help="Held-out data: safetensors with x and y (default: digits val)."),
    ] = None,
    threshold: Annotated[
        float, typer.Option(help="Held-out accuracy a contribution may cost.")
    ] = 0.01,
    max_norm: Annotated[float, typer.Option(help="Refuse deltas of a larger L2 norm.")] = 100.0,
    max_loss_rise: Annotated[
        float, typer.Option(help="Held-out cross-entropy (nats) a contribution may add.")
    ] = 0.1,
    max_body_mb: Annotated[float, typer.Option(help="Refuse bodies above this size.")] = 64.0,
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 7500,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    ssl_certfile: Annotated[str | None, typer.Option(help="TLS certificate (PEM).")] = None,
    ssl_keyfile: Annotated[str | None, typer.Option(help="TLS key (PEM).")] = None,
) -> None:
    """Serve the hub: judge submitted deltas on held-out data, merge the good ones.

    A delta is merged as a new version when its L2 norm is at most --max-norm, every held-out
    output stays finite, the held-out accuracy after it is at least the accuracy before minus
    --threshold and the held-out loss rises by at most --max-loss-rise; every version and the
    latest refusals are logged in --dir."""
    from pydantic import ValidationError
    from safetensors import SafetensorError

    from distml.config import format_validation_error
    from distml.data import digits
    from distml.federated.hub import Hub, HubConfig
    from distml.federated.hub_app import create_hub_app
    from distml.net import serve as serve_app

    try:
        table = read_tokens(tokens, "contributor")
        config = HubConfig(
            model=model, seed=seed, threshold=threshold, max_norm=max_norm,
            max_loss_rise=max_loss_rise,
        )  # fmt: skip
        if not (max_body_mb > 0 and math.isfinite(max_body_mb)):
            raise ValueError(f"--max-body-mb must be a finite number > 0, got {max_body_mb}")
        data = digits("val") if held_out is None else load_client_data(held_out)
        hub = Hub(directory, data, config, initial=initial)
        app = create_hub_app(hub, table, max_body_bytes=int(max_body_mb * 2**20))
    except ValidationError as exc:
        fail_usage(format_validation_error(exc))
    except SafetensorError as exc:  # safetensors' own error, not a ValueError
        fail_usage(f"{held_out}: not a safetensors file ({exc})")
    except (OSError, ValueError) as exc:
        fail_usage(str(exc))
    serve_app(app, host, port, ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile)


@hub_app.command()
def contribute(
    hub_url: HubUrl,
    data: Annotated[
        str,
        typer.Option(
            help="Local data: a safetensors file with tensors x and y, or digits:K/N "
            "(part K of N of the digits training set, for trials)."
        ),
    ],
    description: Annotated[str, typer.Option(help="What this contribution is, for the log.")],
    epochs: Annotated[int, typer.Option(help="Local epochs.")] = 1,
    lr: Annotated[float, typer.Option(help="Learning rate.")] = 0.1,
    batch_size: Annotated[int, typer.Option(help="Batch size (0: all local data).")] = 10,
    lora: Annotated[
        int | None, typer.Option(help="Train LoRA adapters of rank R instead of every weight.")
    ] = None,
    lora_alpha: Annotated[float | None, typer.Option(help="LoRA alpha (default: R).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the shuffling and the adapters.")] = 0,
    ca_cert: CaCert = None,
) -> None:
    """Fine-tune the hub's latest model on local data and submit the delta.

    Prints the new version's record, or exits 1 with the hub's reason for refusing it. The data
    never leaves this machine; the token comes from DISTML_TOKEN."""
    from safetensors import SafetensorError

    from distml.federated.hub_app import HubClient, fine_tune
    from distml.net import ServiceError, token_from_env

    try:
        token = token_from_env()
        if epochs < 1 or batch_size < 0 or not (lr > 0 and math.isfinite(lr)):
            raise ValueError(f"need --epochs >= 1, --batch-size >= 0, --lr > 0; got "
                             f"{epochs}, {batch_size}, {lr}")  # fmt: skip
        if lora is not None and lora < 1 or lora_alpha is not None and not lora_alpha > 0:
            raise ValueError(f"need --lora >= 1 and --lora-alpha > 0; got {lora}, {lora_alpha}")
        if not description.strip():
            raise ValueError("--description must say what the contribution is")
        dataset = load_client_data(data)
    except SafetensorError as exc:  # safetensors' own error, not a ValueError
        fail_usage(f"{data}: not a safetensors file ({exc})")
    except (OSError, ValueError) as exc:
        fail_usage(str(exc))
    hub = HubClient(hub_url, token, verify=ca_cert or True)
    try:
        version, params, meta = hub.model()
        body, kind = fine_tune(
            meta["model"], params, dataset, description=description, lora_r=lora,
            lora_alpha=lora_alpha, epochs=epochs, batch_size=batch_size, lr=lr, seed=seed,
        )  # fmt: skip
        record = hub.contribute(body, base=version, kind=kind)
    except ServiceError as exc:
        report_failure("refused" if exc.status else "hub unreachable", exc)
    finally:
        hub.close()
    typer.echo(json.dumps(record))


@hub_app.command()
def versions(hub_url: HubUrl, ca_cert: CaCert = None) -> None:
    """Print the hub's provenance log (every version, the latest refusals and counts of all)
    as JSON.

    The token comes from DISTML_TOKEN."""
    from distml.federated.hub_app import HubClient
    from distml.net import ServiceError, token_from_env

    try:
        token = token_from_env()
    except ValueError as exc:
        fail_usage(str(exc))
    hub = HubClient(hub_url, token, verify=ca_cert or True)
    try:
        log = hub.versions()
    except ServiceError as exc:
        report_failure("hub", exc)
    finally:
        hub.close()
    typer.echo(json.dumps(log, indent=1))
