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

# What a worker needs: torch, the Context that distml.launch's functions and distml run's
# scripts build, and the default strategy's module, which the Context imports on first use (the
# federated simulation's clients import their own few modules).
WORKER_PRELOAD = ["torch", "distml.runtime.context", "distml.parallel.data"]


def start_fork_server() -> None:
    """Start the fork server, if it is not running yet, importing ``WORKER_PRELOAD``; returns at
    once (the first fork waits for the imports)."""
    multiprocessing.set_forkserver_preload(WORKER_PRELOAD)
    multiprocessing.forkserver.ensure_running()
