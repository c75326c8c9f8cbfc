"""``distml.launch(fn)``: run a function in N worker processes from a script or a notebook."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import cloudpickle
from torch.distributed.elastic.multiprocessing.errors import record

from distml.config import RunConfig, build_config
from distml.launch.elastic import run_workers

T = TypeVar("T")


@record
def _trampoline(payload: bytes) -> Any:
    # The payload is this same user's function, pickled by the parent process on this machine
    # (cloudpickle, so that functions defined in a notebook travel too); it never crosses a network.
    from distml.runtime.context import Context

    fn, args, kwargs = cloudpickle.loads(payload)
    with Context.create() as ctx:
        return fn(ctx, *args, **kwargs)


def launch(
    fn: Callable[..., T],
    *args: Any,
    nproc: int = 2,
    config: RunConfig | None = None,
    **settings: Any,
) -> T | None:
    """Run ``fn(ctx, *args)`` in ``nproc`` worker processes and return rank 0's return value.

    ``settings`` are :class:`distml.config.RunConfig` fields (``max_restarts``, ``run_name``,
    ``timeout_s``, ...). An exception in any worker is raised here as
    :class:`distml.launch.elastic.LaunchError`, naming the rank and carrying its traceback.

    >>> import distml
    >>> def work(ctx):
    ...     return ctx.world_size
    >>> distml.launch(work, nproc=2)  # doctest: +SKIP
    2
    """
    if config is None:
        config = build_config(nproc=nproc, **settings)
    payload = cloudpickle.dumps((fn, args, {}))
    results = run_workers(config, _trampoline, (payload,))
    return results.get(0)
