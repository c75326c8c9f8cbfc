"""Dynamic batching: requests wait in a queue and run through the model together, up to
``max_batch_size`` rows or until the oldest has waited ``max_delay_s``; each gets its own rows
back. Rows are independent in the served models, so a batch's rows equal one-by-one inference.

A request that would overflow the batch, or whose rows have another shape, starts the next
batch. The model runs in one worker thread, so the event loop keeps accepting requests (which
queue up for the next batch) while a batch computes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch


@dataclass
class _Pending:
    x: torch.Tensor
    done: asyncio.Future = field(repr=False)


class DynamicBatcher:
    """>>> batcher = DynamicBatcher(model, max_batch_size=32, max_delay_s=0.002)  # doctest: +SKIP
    >>> y = await batcher.infer(x)                                              # doctest: +SKIP
    """

    def __init__(
        self,
        predict: Callable[[torch.Tensor], torch.Tensor],
        max_batch_size: int = 32,
        max_delay_s: float = 0.002,
        on_batch: Callable[[int], None] | None = None,
    ):
        if max_batch_size < 1 or max_delay_s < 0:
            raise ValueError("max_batch_size must be >= 1 and max_delay_s >= 0")
        self.predict = predict
        self.max_batch_size = max_batch_size
        self.max_delay_s = max_delay_s
        self.on_batch = on_batch
        self._queue: asyncio.Queue[_Pending] | None = None
        self._task: asyncio.Task | None = None
        self._held: _Pending | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="batch")

    async def infer(self, x: torch.Tensor) -> torch.Tensor:
        if self._task is None:  # started in the serving loop, on first use
            self._queue = asyncio.Queue()
            self._task = asyncio.get_running_loop().create_task(self._run())
        assert self._queue is not None
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

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._collect()
            x = torch.cat([p.x for p in batch]) if len(batch) > 1 else batch[0].x
            if self.on_batch is not None:
                self.on_batch(x.shape[0])
            try:
                y = await loop.run_in_executor(self._executor, self.predict, x)
            except Exception as exc:  # the failure belongs to the requests of this batch
                for p in batch:
                    if not p.done.done():
                        p.done.set_exception(exc)
                continue
            start = 0
            for p in batch:
                n = p.x.shape[0]
                if not p.done.done():  # a client that went away cancelled its future
                    p.done.set_result(y[start : start + n])
                start += n

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._executor.shutdown(wait=False)
