"""What a training strategy starts besides its workers, by the strategy's name.

Most strategies live in their workers alone: the launcher starts a torchrun world and each
worker's ``Context`` applies the strategy (:mod:`distml.parallel.registry`). A strategy whose
workers need processes of their own beside them -- the parameter server's shards -- names here
the job that starts those and the workers, and watches them all. ``distml run`` and
``distml.launch`` ask :func:`strategy_job` before starting anything.

A job is ``job(config, argv) -> summary``: it runs the worker command ``argv`` (``python ...``,
started as a command, not forked) in each worker process. Jobs are named ``"module:function"``
and imported on first use: this module costs nothing to import before the command line has
even parsed its flags.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distml.config import RunConfig

Job = Callable[["RunConfig", list[str]], dict[str, Any]]

JOBS: dict[str, str] = {
    "ps": "distml.jobs.ps:run_ps_job",
}


def strategy_job(name: str) -> Job | None:
    """The job that strategy ``name`` runs in place of a torchrun world; None where its
    workers are all it needs."""
    entry = JOBS.get(name)
    if entry is None:
        return None
    module, _, function = entry.partition(":")
    return getattr(importlib.import_module(module), function)
