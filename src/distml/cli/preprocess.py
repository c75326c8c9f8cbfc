"""``distml preprocess``: a coordinator splits the input into shards, workers transform them.

    distml preprocess rows.csv --transform features.py:transform --out data/ --workers 2
    distml preprocess 'images/**/*.png' --transform prep:resize --out data/ --workers 0 \\
        --host 0.0.0.0 --port 7500                         # the coordinator only
    DISTML_TOKEN=... distml preprocess worker --coordinator http://10.0.0.5:7500 \\
        --transform prep:resize --out data/                # on each other host
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer

from distml.cli.default_command import group_with_default
from distml.cli.messages import fail_usage, report_failure

preprocess_app = typer.Typer(
    cls=group_with_default("run"),
    help="Preprocess data in parallel: shards handed to workers, Parquet out.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

Transform = Annotated[str, typer.Option(help="The transform: module:function or file.py:function.")]


def source_of(
    input: str,
    kind: str | None,
    *,
    files_per_shard: int,
    blocksize_mb: float,
    row_groups_per_shard: int,
    rows_per_shard: int,
    sql_table: str | None,
    sql_key: str | None,
):
    """The source INPUT names: a URL is SQL, ``.csv`` CSV, ``.parquet`` (or a folder of them
    with ``--format parquet``) Parquet, anything else a folder or glob of files."""
    from distml.data.preprocess import CsvSource, FilesSource, ParquetSource, SqlSource

    if kind is None:
        if "://" in input:
            kind = "sql"
        elif input.endswith(".csv"):
            kind = "csv"
        elif input.endswith(".parquet"):
            kind = "parquet"
        else:
            kind = "files"
    if kind == "sql":
        if not (sql_table and sql_key):
            raise ValueError("a SQL source needs --sql-table and --sql-key (the column to page by)")
        return SqlSource(url=input, table=sql_table, key=sql_key, rows_per_shard=rows_per_shard)
    if kind == "csv":
        return CsvSource(path=input, blocksize=int(blocksize_mb * 2**20))
    if kind == "parquet":
        root = Path(input)
        paths = sorted(str(p) for p in root.glob("*.parquet")) if root.is_dir() else [input]
        return ParquetSource(paths=paths, row_groups_per_shard=row_groups_per_shard)
    if kind == "files":
        return FilesSource(pattern=input, files_per_shard=files_per_shard)
    raise ValueError(f"--format is one of files, csv, parquet, sql; got {kind!r}")


@preprocess_app.command(name="run")
def run(
    input: Annotated[str, typer.Argument(help="CSV or Parquet file, folder or glob, or SQL URL.")],
    transform: Transform,
    out: Annotated[Path, typer.Option(help="Output folder (Parquet parts, manifest).")],
    workers: Annotated[int, typer.Option(min=0, help="Local worker processes (0: none).")] = 2,
    kind: Annotated[
        str | None, typer.Option("--format", help="files, csv, parquet or sql; default: guessed.")
    ] = None,
    files_per_shard: Annotated[int, typer.Option(min=1)] = 16,
    blocksize_mb: Annotated[float, typer.Option(min=0.001, help="CSV bytes per shard.")] = 16.0,
    row_groups_per_shard: Annotated[int, typer.Option(min=1)] = 1,
    rows_per_shard: Annotated[int, typer.Option(min=1, help="SQL rows per shard.")] = 100_000,
    sql_table: Annotated[str | None, typer.Option(help="The SQL table to read.")] = None,
    sql_key: Annotated[str | None, typer.Option(help="The column it is paged by.")] = None,
    lease_s: Annotated[
        float, typer.Option(min=0.5, help="A silent worker's shard goes back.")
    ] = 30.0,
    max_attempts: Annotated[int, typer.Option(min=1, help="Failures before the job stops.")] = 3,
    speculate_after: Annotated[
        float, typer.Option(min=0, help="Backup copy of a shard this many x the median (0: off).")
    ] = 2.0,
    host: Annotated[str, typer.Option(help="The coordinator's address.")] = "127.0.0.1",
    port: Annotated[int | None, typer.Option(help="The coordinator's port; default: free.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the manifest as JSON.")] = False,
) -> None:
    """Transform INPUT shard by shard into OUT. Shards committed by an earlier run of the same
    job are skipped; workers elsewhere join with ``distml preprocess worker`` (same token)."""
    from pydantic import ValidationError
    from rich.console import Console

    from distml.data.preprocess import OutputError, SourceError
    from distml.data.preprocess.worker import load_transform
    from distml.jobs.preprocess import PreprocessError, preprocess
    from distml.net import TOKEN_ENV, token_from_env

    console = Console(stderr=True)
    try:
        source = source_of(
            input,
            kind,
            files_per_shard=files_per_shard,
            blocksize_mb=blocksize_mb,
            row_groups_per_shard=row_groups_per_shard,
            rows_per_shard=rows_per_shard,
            sql_table=sql_table,
            sql_key=sql_key,
        )
        load_transform(transform)  # fail here, once, not in every worker
        token = token_from_env() if (workers == 0 or TOKEN_ENV in os.environ) else None
    except (ValueError, ValidationError) as exc:
        fail_usage(str(exc))

    def started(url: str) -> None:
        if workers == 0:
            console.print(
                f"coordinator at {url}: start workers with the same token", highlight=False
            )

    try:
        result = preprocess(
            source,
            transform,
            out,
            workers=workers,
            lease_s=lease_s,
            max_attempts=max_attempts,
            speculate_after=speculate_after,
            host=host,
            port=port,
            token=token,
            on_started=started,
        )
    except (SourceError, OutputError) as exc:
        fail_usage(str(exc))
    except PreprocessError as exc:
        report_failure("preprocessing failed", exc)
    manifest = result.manifest
    if as_json:
        print(json.dumps({**manifest, "seconds": result.seconds}))
        return
    stats = manifest["stats"]
    console.print(
        f"{manifest['rows']:,} rows in {len(manifest['parts'])} parts -> {out} "
        f"in {result.seconds:.1f} s ({stats['skipped']} shards skipped, "
        f"{stats['retried']} retried, {stats['speculative']} speculative copies, "
        f"{result.worker_restarts} worker restarts)",
        highlight=False,
    )


@preprocess_app.command()
def worker(
    coordinator: Annotated[str, typer.Option(help="The coordinator's URL.")],
    transform: Transform,
    out: Annotated[
        Path,
        typer.Option(help="The job's output folder, shared with the coordinator."),
    ],
    worker_id: Annotated[
        str | None, typer.Option(help="Default: the host name; the process ID is appended.")
    ] = None,
    ca_cert: Annotated[str | None, typer.Option(help="CA bundle for https.")] = None,
) -> None:
    """Work for a coordinator until its job is done (token from DISTML_TOKEN). The worker
    writes only in OUT and reads only the input named by the job recorded there."""
    from distml.data.preprocess.scope import RefusedAnswer
    from distml.data.preprocess.worker import JobFailed, run_worker
    from distml.net import ServiceError, token_from_env

    try:
        kept = run_worker(
            coordinator,
            token_from_env(),
            transform,
            out,
            worker_id=worker_id,
            verify=ca_cert or True,
        )
    except ValueError as exc:
        fail_usage(str(exc))
    except JobFailed as exc:
        report_failure("the job failed", exc)
    except RefusedAnswer as exc:
        report_failure("the coordinator's answer is refused", exc)
    except ServiceError as exc:
        report_failure("worker stopped", exc)
    typer.echo(f"kept {kept} shard(s)", err=True)
