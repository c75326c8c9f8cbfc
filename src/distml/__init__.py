"""distml: distributed machine learning for PyTorch, from one laptop to a cluster.

``Context``, ``LaunchError``, ``RunConfig`` and ``metrics`` are imported on first use (PEP 562),
so that a process that needs one corner of distml (a preprocessing worker, a replica) pays
neither for importing torch.distributed nor for building the run's pydantic models.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import distml.launch as _launch_package  # the subpackage first, so that ``launch`` below wins
from distml._lazy import lazy_getattr

if TYPE_CHECKING:
    from distml import metrics
    from distml.config import RunConfig
    from distml.launch.elastic import LaunchError
    from distml.runtime.context import Context

__version__ = "0.1.0"

__getattr__ = lazy_getattr(
    "distml",
    {
        "metrics": "distml.metrics",
        "LaunchError": "distml.launch.elastic:LaunchError",
        "Context": "distml.runtime.context:Context",
        "RunConfig": "distml.config:RunConfig",
    },
)


def launch(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(ctx, *args)`` in worker processes and return rank 0's result; the arguments
    are those of :func:`distml.launch.api.launch`."""
    return _launch_package.launch(fn, *args, **kwargs)


def init(config: RunConfig | None = None) -> Context:
    """Join the run from inside a script started by ``distml run``, ``torchrun`` or ``python``."""
    from distml.runtime.context import Context

    return Context.create(config)


__all__ = ["metrics", "Context", "LaunchError", "RunConfig", "init", "launch", "__version__"]
