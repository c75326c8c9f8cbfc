"""Tokens files: the ``{name: token}`` tables that the federated server and the hub read, and
that ``distml fl tokens --out`` writes. Whoever can read such a file can act as anyone in it,
so it is created readable by its owner only, and a server given a file that others may read
says so."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from distml.cli.messages import err

MIN_TOKEN_CHARS = 16


def read_tokens(path: Path, party: str = "client") -> dict[str, str]:
    """The ``{party name: token}`` table of a JSON file; a ValueError says what is wrong. A file
    that group or others may open is still used, with a warning on stderr."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        err.print(
            f"warning: {path} is open to group or others (mode {mode:04o}): whoever reads it "
            f"can act as any {party}; chmod 600 it",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
    table = json.loads(path.read_text())
    if not isinstance(table, dict) or not table:
        raise ValueError(f"{path}: expected a JSON object {{{party} name: token}}")
    short = sorted(
        name for name, t in table.items() if not isinstance(t, str) or len(t) < MIN_TOKEN_CHARS
    )
    if short:
        raise ValueError(
            f"{path}: tokens of {short} are not strings of >= {MIN_TOKEN_CHARS} characters"
        )
    return table


def write_private(path: Path, text: str) -> None:
    """Create ``path`` with mode 0600 and write ``text``: the secret is never in a file others
    can read, not even for a moment (the mode is set at creation, not changed after). An
    existing file is never overwritten (FileExistsError)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
