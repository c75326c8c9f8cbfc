"""How every ``distml`` command reports a mistake or a failure, on stderr.

A module of its own, light to import: ``distml.cli.main`` imports every command, and a command
(or a worker process it starts) must not pay for that to print an error.
"""

from __future__ import annotations

from typing import NoReturn

import typer
from rich.console import Console

err = Console(stderr=True)


def fail_usage(message: str) -> NoReturn:
    """Bad input: the message, and exit code 2."""
    err.print("[bold red]error:[/]", highlight=False, end=" ")
    err.print(message, highlight=False, markup=False, soft_wrap=True)
    raise typer.Exit(2)


def report_failure(what: str, exc: Exception, code: int = 1) -> NoReturn:
    """A run that failed: what failed and why, and exit ``code``. The cause is already told,
    so its traceback is left out."""
    err.print(f"[bold red]{what}:[/]", highlight=False, end=" ")
    err.print(str(exc), highlight=False, markup=False, soft_wrap=True)
    raise typer.Exit(code) from None
