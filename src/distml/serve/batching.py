"""Dynamic batching: requests wait in a queue and run through the model together, up to
``max_batch_size`` rows or until the oldest has waited ``max_delay_s``; each gets its own rows
back. By default ``max_delay_s`` is 0, as in Triton's dynamic batcher: a batch is what has
queued by the time the model is free, so a request never waits for others that may not come,
and under load the requests that arrive during one forward pass make the next batch (under a
closed-loop load, a fixed wait left cores idle and served fewer requests: see
``benchmarks/serving.py``). Rows are independent in the served models, so a batch's rows equal
one-by-one inference.

A request that would overflow the batch, or whose rows have another shape, starts the next
batch. No forward pass ever takes more than ``max_rows`` rows: a request with more is refused
before it is queued. A batch the model takes long on runs in a worker thread, so the event
loop keeps accepting requests (which queue up for the next batch) while it computes; one it
runs through faster than a hand-off to that thread and back runs on the event loop itself
(:data:`INLINE_FORWARD_S`, judged from the last batch's time per row).

The batching loop is a background loop of the service (:class:`~distml.net.BackgroundLoops`):
a batch that fails fails its own requests, is logged, and the loop goes on with the next.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from distml.net import BackgroundLoops

MAX_BATCH_ROWS = 1024
# A forward pass expected to take less runs on the event loop: handing a batch to the worker
# thread and back costs tens of microseconds of CPU, more than a small model's one-row pass,
# while the few requests that could arrive meanwhile wait for the next batch in either case.
INLINE_FORWARD_S = 0.001
log = logging.getLogger("distml.serve")


class InferenceFailed(Exception):
    """The model raised on a request's rows, run on their own: the request is the cause."""


class BatchFailed(RuntimeError):
    """The batch a request was in failed for a cause other than its rows (a fault of the
    service, not of the request)."""


@dataclass
class _Pending:
    x: torch.Tensor
    done: asyncio.Future = field(repr=False)


class DynamicBatcher:
    """>>> batcher = DynamicBatcher(model, max_batch_size=32)                    # doctest: +SKIP
    >>> y = await batcher.infer(x)                                              # doctest: +SKIP
    """

    def __init__(
        self,
        predict: Callable[[torch.Tensor], torch.Tensor],
        max_batch_size: int = 32,
        max_delay_s: float = 0.0,
        on_batch: Callable[[int], None] | None = None,
        max_rows: int = MAX_BATCH_ROWS,
    ):
        if max_batch_size < 1 or max_delay_s < 0:
            raise ValueError("max_batch_size must be >= 1 and max_delay_s >= 0")
        if max_rows < max_batch_size:
            raise ValueError(
                f"max_rows ({max_rows}) must be at least max_batch_size ({max_batch_size})"
            )
        self.predict = predict
        self.max_batch_size = max_batch_size
        self.max_delay_s = max_delay_s
        self.max_rows = max_rows
        self.on_batch = on_batch
        self._queue: asyncio.Queue[_Pending] | None = None
        self._task: asyncio.Task | None = None
        self._own_loops: BackgroundLoops | None = None
        self._held: _Pending | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="batch")
        self._seconds_per_row: float | None = None  # the last batch's; None before the first

    def start(self, loops: BackgroundLoops) -> None:
        """Run the batching loop as one of ``loops`` (a service's, so that its ``/healthz``
        reports the loop if it ever stops); call it in the serving event loop."""
        self._queue = asyncio.Queue()
        self._task = loops.start("batcher", self.run_batch)

    async def infer(self, x: torch.Tensor) -> torch.Tensor:
        """The model's rows for ``x``; ``ValueError`` for more than ``max_rows`` rows,
        :class:`InferenceFailed` when the model raises on them, :class:`BatchFailed` when
        their batch failed otherwise."""
        if x.shape[0] > self.max_rows:
            raise ValueError(f"{x.shape[0]} rows, over the limit of {self.max_rows} per batch")
        if self._task is None:  # used outside a service: the batcher runs its own loop
            self._own_loops = BackgroundLoops()
            self.start(self._own_loops)
        assert self._queue is not None and self._task is not None
        if self._task.done():
            raise BatchFailed("the batching loop has stopped")
        done = asyncio.get_running_loop().create_future()
        await self._queue.put(_Pending(x, done))
        return await done

    async def _next(self, timeout: float | None) -> _Pending | None:
        assert self._queue is not None
        if self._held is not None:
            item, self._held = self._held, None
            return item
        if timeout is None:
            return await self._queue.get()
        if timeout <= 0:
            return None if self._queue.empty() else self._queue.get_nowait()
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            return None

    async def _collect(self) -> list[_Pending]:
        loop = asyncio.get_running_loop()
        first = await self._next(None)
        assert first is not None
        batch, rows = [first], first.x.shape[0]
        deadline = loop.time() + self.max_delay_s
        while rows < self.max_batch_size:
            item = await self._next(deadline - loop.time())
            if item is None:
                break
            n = item.x.shape[0]
            if item.x.shape[1:] != first.x.shape[1:] or rows + n > self.max_batch_size:
                self._held = item
                break
            batch.append(item)
            rows += n
        return batch

    async def run_batch(self) -> None:
        """Gather one batch and answer each of its requests. Whatever goes wrong fails the
        requests of this batch only, and is raised for the loop to log."""
        batch = await self._collect()
        try:
            await self._answer(batch)
        except BaseException as exc:  # re-raised: the loop logs it, a cancel ends the loop
            cause = BatchFailed(f"the batch failed: {type(exc).__name__}")
            for p in batch:
                _fail(p, cause)
            raise

    async def _answer(self, batch: list[_Pending]) -> None:
        x = torch.cat([p.x for p in batch]) if len(batch) > 1 else batch[0].x
        if self.on_batch is not None:
            self.on_batch(x.shape[0])
        try:
            if self._short(x.shape[0]):
                y = self._run(x)
            else:
                y = await asyncio.get_running_loop().run_in_executor(self._executor, self._run, x)
        except Exception as exc:
            if len(batch) > 1:  # find the request at fault: the others still get answers
                for p in batch:
                    await self._answer([p])
                return
            log.warning("the model failed on a request of %d rows: %r", x.shape[0], exc)
            _fail(batch[0], InferenceFailed(f"the model failed on this input: {exc!r}"))
            return
        start = 0
        for p in batch:
            n = p.x.shape[0]
            if not p.done.done():  # a client that went away cancelled its future
                p.done.set_result(y[start : start + n])
            start += n

    def _short(self, rows: int) -> bool:
        per_row = self._seconds_per_row
        return per_row is not None and per_row * rows < INLINE_FORWARD_S

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        y = self.predict(x)
        self._seconds_per_row = (time.perf_counter() - start) / max(1, x.shape[0])
        if y.shape[:1] != x.shape[:1]:
            raise RuntimeError(f"the model gave {y.shape[0]} rows for {x.shape[0]}")
        return y

    async def close(self) -> None:
        if self._own_loops is not None:
            await self._own_loops.stop()
        elif self._task is not None:
            self._task.cancel()
        self._executor.shutdown(wait=False)


def _fail(pending: _Pending, exc: Exception) -> None:
    if not pending.done.done():
        pending.done.set_exception(exc)
