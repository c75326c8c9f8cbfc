"""``distml serve``: a model behind the Open Inference Protocol, on one machine or many.

    distml serve CHECKPOINT --replicas 2 --model digits-cnn    # replicas sharing one port (Linux)
    distml serve CHECKPOINT --replicas 2 --balance router      # replicas behind a router
    distml serve replica CHECKPOINT --model digits-cnn --port 8101   # one replica, any host
    distml serve router --replica http://a:8101 --replica http://b:8101 --port 8100

The token comes from DISTML_TOKEN (>= 16 characters); clients send it as a bearer token. A
deployment or a replica that listens on the loopback only makes one when DISTML_TOKEN is not
set, and prints it once, on the terminal; beyond the loopback it refuses to start without one.
With ``--grpc-port`` the replicas also serve the KServe v2 gRPC API (``pip install
'distml[grpc]'``); the router stays HTTP.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import quote

import typer
from rich.console import Console

from distml.cli.default_command import group_with_default
from distml.cli.messages import fail_usage, report_failure
from distml.net.token import TOKEN_ENV, service_token, token_from_env

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
MaxDelay = Annotated[
    float,
    typer.Option(
        min=0, help="Longest wait for a batch to fill, in ms; 0: a batch is what has queued."
    ),
]
CertFile = Annotated[str | None, typer.Option(help="TLS certificate (PEM).")]
KeyFile = Annotated[str | None, typer.Option(help="TLS key (PEM).")]


def _token(*hosts: str) -> tuple[str, bool]:
    """DISTML_TOKEN, or one made for a service on the loopback; and whether it was made."""
    try:
        return service_token(*hosts)
    except ValueError as exc:
        fail_usage(str(exc))


def _show_made_token(console: Console, token: str, url: str) -> None:
    """The token made for this run, once, on the terminal and never in a log, with a request
    that works as it stands (as Jupyter prints its URL with its token)."""
    console.print(
        f"no {TOKEN_ENV} was set, so this run made one (it listens on the loopback only);\n"
        f"clients send it as a bearer token:\n"
        f"    export {TOKEN_ENV}={token}\n"
        f"    curl -H 'Authorization: Bearer {token}' {url}",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )


def _url(scheme: str, host: str, port: int, path: str = "") -> str:
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}{path}"


def _grpc_service_class() -> Any:
    """:class:`~distml.serve.grpc_service.GrpcService`, or a usage error naming the extra."""
    try:
        # grpcio and tritonclient are the optional extra distml[grpc]: imported only when a
        # gRPC port is asked for.
        from distml.serve.grpc_service import GrpcService
    except ImportError as exc:
        fail_usage(f"--grpc-port: {exc}")
    return GrpcService


def _until_signal() -> None:
    """Block until SIGINT or SIGTERM."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()


def _stop_on_sigterm() -> threading.Event:
    """From now on a SIGTERM unwinds as Ctrl-C does, and is remembered: the interrupt it raises
    is lost where it lands in code whose exceptions Python ignores (a callback of the import
    machinery, a finalizer), and the event still tells the caller that it came."""
    stopping = threading.Event()

    def interrupt(signum: int, frame: Any) -> None:
        stopping.set()
        signal.default_int_handler(signum, frame)

    signal.signal(signal.SIGTERM, interrupt)
    return stopping


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
    max_delay_ms: MaxDelay = 0.0,
    max_batch_rows: MaxRows = 1024,
    log_dir: Annotated[Path | None, typer.Option(help="Replica logs; default: a temp dir.")] = None,
    ssl_certfile: CertFile = None,
    ssl_keyfile: KeyFile = None,
    grpc_port: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=65535,
            help="Replica i also serves the KServe v2 gRPC API on GRPC_PORT + i, at --host "
            "(the router stays HTTP; pip install 'distml\\[grpc]').",
        ),
    ] = None,
    balance: Annotated[
        Literal["kernel", "router"] | None,
        typer.Option(
            help="kernel: the replicas share --port (SO_REUSEPORT) and the kernel spreads the "
            "connections, with no hop between: less CPU a request, but a replica that dies "
            "fails the requests it holds. router: a router in front retries a failed request "
            "on another replica, and terminates TLS. Default: kernel on Linux, router with "
            "--ssl-certfile or on other systems (where SO_REUSEPORT does not spread "
            "connections).",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Start REPLICAS replica processes of CHECKPOINT on this machine, sharing one port or behind
    a router; a replica that dies is restarted. Ctrl-C drains the router (or the replicas), then
    stops the replicas."""
    from distml.config import ConfigError
    from distml.jobs.replicas import ReplicaCommand, ReplicaSet
    from distml.serve.model import load_served_model
    from distml.serve.router import Router
    from distml.serve.router_app import create_router_app, run_router

    _check_rows(max_batch_size, max_batch_rows)
    token, made = _token(host)
    if grpc_port is not None:
        _grpc_service_class()
        if ssl_certfile:
            fail_usage(
                "--grpc-port: a deployment's replicas serve gRPC without TLS; for gRPC over "
                "TLS start each replica with distml serve replica --grpc-port PORT "
                "--ssl-certfile CERT --ssl-keyfile KEY"
            )
        if grpc_port + replicas - 1 > 65535:
            fail_usage(f"--grpc-port: {replicas} ports from {grpc_port} go past port 65535")
    if balance is None:
        balance = "kernel" if sys.platform == "linux" and not ssl_certfile else "router"
    kernel = balance == "kernel"
    if kernel and ssl_certfile:
        fail_usage(
            "--balance kernel: the replicas serve plain HTTP; for TLS use --balance router, "
            "or put a TLS terminator in front of the shared port"
        )
    try:
        served = load_served_model(checkpoint, model, name)  # fail here, not in every replica
    except ConfigError as exc:
        fail_usage(str(exc))
    command = ReplicaCommand(
        str(checkpoint),
        model,
        name,
        max_batch_size,
        max_delay_ms,
        max_batch_rows,
        grpc_port=grpc_port,
        grpc_host=host,
        shared=(host, port) if kernel else None,
    )
    console = Console(stderr=True)
    scheme = "https" if ssl_certfile else "http"
    # A SIGTERM before the replicas serve unwinds as Ctrl-C does, so that the replicas already
    # started are stopped (its default would end this process and leave them running); once
    # they serve, the serving loop takes the signals over.
    stopping = _stop_on_sigterm()
    try:
        with ReplicaSet(command, replicas, token, log_dir=log_dir) as replica_set:

            def started() -> None:
                url = _url(scheme, host, port)
                how = ", sharing the port" if kernel else ""
                console.print(f"serving {replicas} replica(s){how} at {url}/v2", highlight=False)
                if replica_set.grpc_targets:
                    targets = ", ".join(replica_set.grpc_targets)
                    console.print(f"gRPC (KServe v2) on the replicas at {targets}", highlight=False)
                if made:
                    metadata = _url(scheme, host, port, f"/v2/models/{quote(served.name, safe='')}")
                    _show_made_token(console, token, metadata)

            try:
                replica_set.wait_ready()
            except (RuntimeError, TimeoutError) as exc:
                report_failure("the replicas did not start", exc)
            if stopping.is_set():  # a SIGTERM came, and its interrupt was lost on the way
                raise KeyboardInterrupt
            if kernel:
                started()
                _until_signal()  # leaving the block stops the replicas: each finishes its requests
                return
            router = Router(replica_set.urls, token)
            run_router(
                create_router_app(router, token),
                router,
                host,
                port,
                ssl_certfile=ssl_certfile,
                ssl_keyfile=ssl_keyfile,
                on_started=started,
            )
    except KeyboardInterrupt:
        console.print("stopped before the replicas were serving", highlight=False)


@serve_app.command()
def replica(
    checkpoint: Annotated[Path, typer.Argument(help="Run folder or exported safetensors file.")],
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8001,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    model: Model = None,
    name: Name = None,
    max_batch_size: MaxBatch = 32,
    max_delay_ms: MaxDelay = 0.0,
    max_batch_rows: MaxRows = 1024,
    max_body_mb: Annotated[float, typer.Option(help="Largest request body accepted.")] = 16.0,
    ssl_certfile: CertFile = None,
    ssl_keyfile: KeyFile = None,
    grpc_port: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=65535,
            help="Also serve the KServe v2 gRPC API on this port, over TLS with --ssl-certfile "
            "and --ssl-keyfile (pip install 'distml\\[grpc]').",
        ),
    ] = None,
    grpc_host: Annotated[
        str | None, typer.Option(help="Address of the gRPC port; default: --host.")
    ] = None,
    shared_port: Annotated[
        int | None,
        typer.Option(
            min=0,
            max=65535,
            help="Also serve this port, bound with SO_REUSEPORT: replicas on one host started "
            "with the same --shared-port share it, and the kernel spreads connections over them.",
        ),
    ] = None,
    shared_host: Annotated[
        str | None, typer.Option(help="Address of the shared port; default: --host.")
    ] = None,
) -> None:
    """Serve one replica of CHECKPOINT (put a router in front of several, or give them one
    --shared-port)."""
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
    grpc_host = grpc_host or host
    shared = None if shared_port is None else (shared_host or host, shared_port)
    token, made = _token(
        host,
        *([grpc_host] if grpc_port is not None else []),
        *([shared[0]] if shared is not None else []),
    )
    max_body = int(max_body_mb * 2**20)
    grpc = None
    if grpc_port is not None:
        service = _grpc_service_class()
        try:
            grpc = service(token, grpc_port, grpc_host, ssl_certfile, ssl_keyfile, max_body)
        except ValueError as exc:
            fail_usage(f"--grpc-port: {exc}")
    try:
        served = load_served_model(checkpoint, model, name)
    except ConfigError as exc:
        fail_usage(str(exc))
    app = create_replica_app(
        served,
        token,
        max_batch_size=max_batch_size,
        max_delay_ms=max_delay_ms,
        max_body=max_body,
        max_batch_rows=max_batch_rows,
        grpc=None if grpc is None else grpc.serving,
    )
    if made:
        scheme = "https" if ssl_certfile else "http"
        path = f"/v2/models/{quote(served.name, safe='')}"
        _show_made_token(Console(stderr=True), token, _url(scheme, host, port, path))
    serve(app, host, port, shared=shared, ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile)


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
    """Route requests over replicas started elsewhere (``distml serve replica``), with their
    token: DISTML_TOKEN."""
    from distml.serve.router import Router
    from distml.serve.router_app import create_router_app, run_router

    try:
        token = token_from_env()  # the replicas' token: one made here would fit none of them
    except ValueError as exc:
        fail_usage(str(exc))
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
