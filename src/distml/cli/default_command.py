"""A command group whose first argument may be the default command's own: ``distml serve CKPT``
means ``distml serve deploy CKPT`` and ``distml preprocess INPUT`` means ``distml preprocess run
INPUT``, while ``distml serve replica`` and ``distml preprocess worker`` stay subcommands."""

from __future__ import annotations

import click
from typer.core import TyperGroup


def group_with_default(command: str) -> type[TyperGroup]:
    """A typer group class that runs ``command`` when the first word names no subcommand."""

    class DefaultCommandGroup(TyperGroup):
        def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
            if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
                args = [command, *args]
            return super().parse_args(ctx, args)

    return DefaultCommandGroup
