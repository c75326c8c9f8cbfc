"""``distml.launch(fn)``: run a function in N worker processes from a script or a notebook."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import cloudpickle
import torch
from torch.distributed.elastic.multiprocessing.errors import record

from distml.config import RunConfig, build_config
from distml.jobs.strategy_jobs import Job, strategy_job
from distml.launch.elastic import run_workers

T = TypeVar("T")


@record
def _trampoline(payload: bytes) -> Any:
    # The payload is this same user's function, pickled by the parent process on this machine
    # (cloudpickle, so that functions defined in a notebook travel too); it never crosses a network.
    # Context is imported here, in the worker: the launching process never builds one, and
    # need not pay for the runtime's modules.
    from distml.runtime.context import Context

    fn, args, kwargs = cloudpickle.loads(payload)
    with Context.create() as ctx:
        return fn(ctx, *args, **kwargs)


def _command_worker_main(payload_path: str) -> None:
    """A worker of a strategy's job, started as a command by ``launch``: run the function, keep
    its result
    (tensors, numbers, lists and dicts: what ``torch.load(weights_only=True)`` reads back)
    beside the payload, in the launcher's private folder."""
    from distml.runtime.context import Context  # as in _trampoline

    path = Path(payload_path)
    # The parent's import path, as multiprocessing's spawn passes it: functions pickled by
    # reference (a test module's, a script's) import from where the parent found them.
    sys.path[:0] = [p for p in json.loads(path.with_suffix(".path.json").read_text())]
    fn, args, kwargs = cloudpickle.loads(path.read_bytes())
    with Context.create() as ctx:
        result = fn(ctx, *args, **kwargs)
        attempt = os.environ.get("DISTML_ATTEMPT", "0")
        torch.save(result, path.parent / f"result-rank-{ctx.rank}-{attempt}.pt")


def _launch_job(job: Job, config: RunConfig, payload: bytes) -> Any:
    """Hand this process's own function to the workers of a strategy's job (a parameter
    server's), which start as commands (not forked), through files of a folder private to this
    user.

    The files are a pickle that each worker unpickles, so whoever could write them could run
    code as this user: they are never put where others may write (the run folder may be
    shared). ``tempfile.mkdtemp`` creates the folder with mode 0700 under a fresh name, so no
    other user can create, replace or read a file in it; it is removed when the job ends."""
    private = Path(tempfile.mkdtemp(prefix="distml-launch-"))
    try:
        path = private / "payload.pkl"
        path.write_bytes(payload)
        path.with_suffix(".path.json").write_text(json.dumps(sys.path))
        code = (
            f"from distml.launch.api import _command_worker_main; "
            f"_command_worker_main({str(path)!r})"
        )
        job(config, [sys.executable, "-u", "-c", code])
        results = sorted(private.glob("result-rank-0-*.pt"))
        return torch.load(results[-1], weights_only=True) if results else None
    finally:
        shutil.rmtree(private, ignore_errors=True)


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
    if (job := strategy_job(config.strategy.name)) is not None:  # e.g. shards and workers
        return _launch_job(job, config, payload)
    results = run_workers(config, _trampoline, (payload,))
    return results.get(0)
