"""Starting worker processes: locally, across nodes, and again after a failure.

Its names are imported on first use (PEP 562): ``import distml`` stays light for processes that
never launch anything (a preprocessing worker, a replica).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distml._lazy import lazy_getattr

if TYPE_CHECKING:
    from distml.launch.api import launch
    from distml.launch.elastic import LaunchError, WorkerFailure, run_workers

__getattr__ = lazy_getattr(
    "distml.launch",
    {
        "launch": "distml.launch.api:launch",
        "run_workers": "distml.launch.elastic:run_workers",
        "LaunchError": "distml.launch.elastic:LaunchError",
        "WorkerFailure": "distml.launch.elastic:WorkerFailure",
    },
)

__all__ = ["launch", "run_workers", "LaunchError", "WorkerFailure"]
