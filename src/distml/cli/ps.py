"""``distml ps``: parameter-server shards as standalone services."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from distml.cli.messages import fail_usage
from distml.config import ConfigError, build_config, load_config, parse_consistency

ps_app = typer.Typer(
    help="Parameter servers: serve a shard that workers push to and pull from.",
    no_args_is_help=True,
)


@ps_app.command()
def serve(
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 7300,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    workers: Annotated[int, typer.Option(help="Workers of the job (backups included).")] = 1,
    consistency: Annotated[str, typer.Option(help="bsp, asp or ssp:S.")] = "bsp",
    backup_workers: Annotated[int, typer.Option(help="BSP: gradients not waited for.")] = 0,
    staleness_lr: Annotated[
        bool, typer.Option(help="Divide a push's learning rate by 1 + its staleness.")
    ] = False,
    snapshot: Annotated[
        Path | None, typer.Option(help="Snapshot file: restored at start, written as it goes.")
    ] = None,
    snapshot_every: Annotated[int, typer.Option(help="Versions between snapshots.")] = 50,
    heartbeat_timeout: Annotated[
        float, typer.Option(help="Seconds of silence before a worker leaves the barrier.")
    ] = 10.0,
    max_body_mb: Annotated[float, typer.Option(help="Largest request body accepted.")] = 256.0,
    ssl_certfile: Annotated[str | None, typer.Option(help="TLS certificate (PEM).")] = None,
    ssl_keyfile: Annotated[str | None, typer.Option(help="TLS key (PEM).")] = None,
    config: Annotated[
        Path | None,
        typer.Option(help="A run's config.toml: its ps settings and workers, for the flags above."),
    ] = None,
) -> None:
    """Serve one parameter-server shard. The token comes from DISTML_TOKEN (>= 16 characters);
    workers send it as a bearer token."""
    from distml.net import serve as serve_app
    from distml.net import token_from_env
    from distml.ps.app import create_shard_app
    from distml.ps.shard import ParameterShard, ShardSettings

    try:
        if config is not None:  # a shard of a `distml run --strategy ps` job: the run's settings
            run = load_config(config)
            cfg, workers = run.ps, run.world_size
        else:
            cfg = build_config(
                strategy={"name": "ps"},
                nproc=workers,
                ps={
                    **parse_consistency(consistency),
                    "backup_workers": backup_workers,
                    "staleness_lr": staleness_lr,
                    "snapshot_every": snapshot_every,
                    "heartbeat_timeout_s": heartbeat_timeout,
                    "max_body_mb": max_body_mb,
                },
            ).ps
        token = token_from_env()
    except (ConfigError, ValueError) as exc:
        fail_usage(str(exc))
    if not 0 < port < 65536:
        fail_usage(f"--port {port} is not a TCP port")
    settings = ShardSettings(
        consistency=cfg.consistency,
        staleness=cfg.staleness,
        backup_workers=cfg.backup_workers,
        workers=workers,
        staleness_lr=cfg.staleness_lr,
        heartbeat_timeout_s=cfg.heartbeat_timeout_s,
    )
    app = create_shard_app(
        ParameterShard(settings),
        token,
        snapshot_path=snapshot,
        snapshot_every=cfg.snapshot_every,
        max_body_bytes=int(cfg.max_body_mb * 2**20),
    )
    serve_app(app, host, port, ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile)
