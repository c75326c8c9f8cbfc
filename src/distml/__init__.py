"""distml: distributed machine learning for PyTorch, from one laptop to a cluster."""

from distml import metrics
from distml.config import RunConfig
from distml.launch import LaunchError, launch
from distml.runtime.context import Context

__version__ = "0.1.0"


def init(config: RunConfig | None = None) -> Context:
    """Join the run from inside a script started by ``distml run``, ``torchrun`` or ``python``."""
    return Context.create(config)


__all__ = ["metrics", "Context", "LaunchError", "RunConfig", "init", "launch", "__version__"]
