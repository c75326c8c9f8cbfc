"""``distml serve``: a model behind the Open Inference Protocol, on one machine or many.

    distml serve CHECKPOINT --replicas 2 --model digits-cnn     # replicas + router, this host
    distml serve replica CHECKPOINT --model digits-cnn --port 8101   # one replica, any host
    distml serve router --replica http://a:8101 --replica http://b:8101 --port 8100

The token comes from DISTML_TOKEN (>= 16 characters); clients send it as a bearer token.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from distml.cli.default_command import group_with_default
from distml.cli.messages import fail_usage

DEPLOY = "deploy"


serve_app = typer.Typer(
    cls=group_with_default(DEPLOY),
    help="Serve a model: replicas behind a router, with the Open Inference Protocol v2 API.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

Model = Annotated[
    str | None, typer.Option(help="Architecture (digits-cnn, digits-mlp, gpt); default: the run's.")
]
Name = Annotated[str | None, typer.Option(help="Name served under; default: the architecture.")]
MaxBatch = Annotated[int, typer.Option(min=1, help="Rows per batch, at most (1: no batching).")]
MaxRows = Annotated[
    int,
    typer.Option(
        min=1, help="Rows per request and per forward pass, at most (more: refused with 413)."
    ),
]
MaxDelay = Annotated[float, typer.Option(min=0, help="Longest wait for a batch to fill, in ms.")]
CertFile = Annotated[str | None, typer.Option(help="TLS certificate (PEM).")]
KeyFile = Annotated[str | None, typer.Option(help="TLS key (PEM).")]


def _token() -> str:
    from distml.net import token_from_env

    try:
        return token_from_env()
    except ValueError as exc:
        fail_usage(str(exc))


def _check_rows(max_batch_size: int, max_batch_rows: int) -> None:
    """A batch the batcher fills may not outgrow the cap on one forward pass."""
    if max_batch_size > max_batch_rows:
        fail_usage(
            f"--max-batch-size ({max_batch_size}) must not exceed "
            f"--max-batch-rows ({max_batch_rows})"
        )


@serve_app.command(name=DEPLOY)
def deploy(
    checkpoint: Annotated[Path, typer.Argument(help="Run folder or exported safetensors file.")],
    replicas: Annotated[int, typer.Option(min=1, help="Replica processes.")] = 2,
    port: Annotated[int, typer.Option(help="The router's port.")] = 8000,
    host: Annotated[str, typer.Option(help="The router's address.")] = "127.0.0.1",
    model: Model = None,
    name: Name = None,
    max_batch_size: MaxBatch = 32,
    max_delay_ms: MaxDelay = 2.0,
    max_batch_rows: MaxRows = 1024,
    log_dir: Annotated[Path | None, typer.Option(help="Replica logs; default: a temp dir.")] = None,
    ssl_certfile: CertFile = None,
    ssl_keyfile: KeyFile = None,
) -> None:
    """Start REPLICAS replica processes of CHECKPOINT on this machine and a router in front of
    them; a replica that dies is restarted. Ctrl-C drains the router, then stops the replicas."""
    from rich.console import Console

    from distml.config import ConfigError
    from distml.jobs.replicas import ReplicaCommand, ReplicaSet
    from distml.serve.model import load_served_model
    from distml.serve.router import Router
    from distml.serve.router_app import create_router_app, run_router

    _check_rows(max_batch_size, max_batch_rows)
    token = _token()
    try:
        load_served_model(checkpoint, model, name)  # fail here, once, not in every replica
    except ConfigError as exc:
        fail_usage(str(exc))
    command = ReplicaCommand(
        str(checkpoint), model, name, max_batch_size, max_delay_ms, max_batch_rows
    )
    console = Console(stderr=True)
    with ReplicaSet(command, replicas, token, log_dir=log_dir) as replica_set:
        replica_set.wait_ready()
        router = Router(replica_set.urls, token)
        scheme = "https" if ssl_certfile else "http"
        run_router(
            create_router_app(router, token),
            router,
            host,
            port,
            ssl_certfile=ssl_certfile,
            ssl_keyfile=ssl_keyfile,
            on_started=lambda: console.print(
                f"serving {replicas} replica(s) at {scheme}://{host}:{port}/v2", highlight=False
            ),
        )


@serve_app.command()
def replica(
    checkpoint: Annotated[Path, typer.Argument(help="Run folder or exported safetensors file.")],
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8001,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    model: Model = None,
    name: Name = None,
    max_batch_size: MaxBatch = 32,
    max_delay_ms: MaxDelay = 2.0,
    max_batch_rows: MaxRows = 1024,
    max_body_mb: Annotated[float, typer.Option(help="Largest request body accepted.")] = 16.0,
    ssl_certfile: CertFile = None,
    ssl_keyfile: KeyFile = None,
) -> None:
    """Serve one replica of CHECKPOINT (put a router in front of several)."""
    # Requests come with gaps between them, and OpenMP's threads spin through each gap unless
    # told to sleep: the spinning costs a replica several times a request's own CPU (figures in
    # BENCHMARKS.md, serving) and starves the router and the other replicas of the same cores.
    # libgomp reads this once, when torch is first imported.
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from distml.config import ConfigError
    from distml.net import serve
    from distml.serve.model import load_served_model
    from distml.serve.replica import create_replica_app

    _check_rows(max_batch_size, max_batch_rows)
    token = _token()
    try:
        served = load_served_model(checkpoint, model, name)
    except ConfigError as exc:
        fail_usage(str(exc))
    app = create_replica_app(
        served,
        token,
        max_batch_size=max_batch_size,
        max_delay_ms=max_delay_ms,
        max_body=int(max_body_mb * 2**20),
        max_batch_rows=max_batch_rows,
    )
    serve(app, host, port, ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile)


@serve_app.command()
def router(
    replica_urls: Annotated[
        list[str], typer.Option("--replica", help="A replica's URL; repeat for each.")
    ],
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    ca_file: Annotated[str | None, typer.Option(help="CA bundle for https replicas.")] = None,
    ssl_certfile: CertFile = None,
    ssl_keyfile: KeyFile = None,
) -> None:
    """Route requests over replicas started elsewhere (``distml serve replica``)."""
    from distml.serve.router import Router
    from distml.serve.router_app import create_router_app, run_router

    token = _token()
    router_ = Router(replica_urls, token, verify=ca_file or True)
    run_router(
        create_router_app(router_, token),
        router_,
        host,
        port,
        ssl_certfile=ssl_certfile,
        ssl_keyfile=ssl_keyfile,
    )


if __name__ == "__main__":  # how the supervisor starts replicas
    serve_app()
