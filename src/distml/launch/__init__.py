"""Starting worker processes: locally, across nodes, and again after a failure."""

from distml.launch.api import launch
from distml.launch.elastic import LaunchError, WorkerFailure, run_workers

__all__ = ["launch", "run_workers", "LaunchError", "WorkerFailure"]
