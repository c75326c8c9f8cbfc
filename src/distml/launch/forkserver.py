"""multiprocessing's fork server, preloaded: worker processes fork from it with torch already
imported, instead of each paying the import (about 2 s of CPU here).

The server imports torch without touching CUDA, so the forks may use it. It is started once per
launching process and lives as long as that process; its preload list is the one set when it
starts. This module imports no torch itself, so that a launcher can start the server first and
import torch in parallel with it.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver

# What a launched worker needs: torch and distml's worker side (distml.launch, distml.run).
WORKER_PRELOAD = ["torch", "distml.runtime.context"]


def start_fork_server(preload: list[str] = WORKER_PRELOAD) -> None:
    """Start the fork server, if it is not running yet, importing ``preload``; returns at once
    (the first fork waits for the imports)."""
    multiprocessing.set_forkserver_preload(preload)
    multiprocessing.forkserver.ensure_running()
