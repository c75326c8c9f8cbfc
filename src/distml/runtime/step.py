"""One training step, the same for every strategy: the batch cut into micro-batches, forward and
backward of each, the update, and what the step cost (time, communication, memory).

The strategy (:class:`distml.parallel.strategy.TrainingStrategy`) says how each part is done;
this loop alone fixes their order and cuts the micro-batches.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any

import torch

from distml.config import RunConfig
from distml.parallel.strategy import Objective, StepTrace, TrainingStrategy
from distml.telemetry.memory import ActivationTracker, model_state_bytes
from distml.telemetry.recorder import StepRecord, StepRecorder


def split(batch: Any, parts: int) -> list[Any]:
    """Split a tensor, or a tuple/list of tensors, into ``parts`` micro-batches along dim 0."""
    if isinstance(batch, torch.Tensor):
        return list(torch.tensor_split(batch, parts))
    columns = [torch.tensor_split(t, parts) for t in batch]
    return [type(batch)(col[i] for col in columns) for i in range(parts)]


def batch_len(batch: Any) -> int:
    return len(batch if isinstance(batch, torch.Tensor) else batch[0])


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    return type(batch)(to_device(t, device) for t in batch)


class StepLoop:
    """The training steps of one rank, and what carries from one to the next: the memory of
    the last sampled step, and the last step's own compute (for a simulated straggler)."""

    def __init__(self, config: RunConfig, rank: int, device: torch.device, recorder: StepRecorder):
        self.config = config
        self.rank = rank
        self.device = device
        self.recorder = recorder
        self._activations = ActivationTracker()
        self._memory: dict[str, int] | None = None
        self._last_compute = 0.0

    def run(
        self,
        strategy: TrainingStrategy,
        optimizer: torch.optim.Optimizer,
        batch: Any,
        objective: Objective,
        step: int,
    ) -> StepRecord:
        """Step number ``step`` on ``batch``; its record (``loss``: the batch's mean loss).

        With ``grad_accum = K`` the batch is cut into K micro-batches whose gradients accumulate
        locally and are reduced once, with the last: the same gradient as the whole batch at
        once, with 1/K of the activation memory.

        On sampled steps (:meth:`sampled`) the saved activations are tracked and the model state
        is counted before the gradients go, and a strategy whose collectives cannot be inferred
        intercepts them; the steps in between repeat the last sample's memory.
        """
        rec = self.recorder
        rec.begin_step()
        slept = self._simulate_straggler()
        batch = to_device(batch, self.device)
        total = batch_len(batch)
        parts = min(self.config.strategy.grad_accum, total)
        micro_batches = split(batch, parts) if parts > 1 else [batch]
        trace = StepTrace(sampled=self.sampled(step))
        counted = trace.sampled and strategy.counts_memory
        if counted:
            self._activations.reset()
        losses = []
        with strategy.traced(trace):
            with self._activations if counted else nullcontext():
                for i, micro in enumerate(micro_batches):
                    # Weighted by size: the micro-batches of a split may differ by one.
                    weight = batch_len(micro) / total if parts > 1 else 1.0
                    last = i == parts - 1
                    losses.append(strategy.forward_backward(micro, objective, weight, last))
            strategy.after_backward()
            trace.backward_done = time.perf_counter()
            rec.add_exposed(strategy.step(optimizer, step))
        if counted:
            self._count_memory(strategy, optimizer, trace.params_peak)
        optimizer.zero_grad(set_to_none=True)
        record = rec.end_step(
            step,
            float(sum(losses)),
            total,
            trace.backward_done,
            memory=self._memory,
            pipeline=trace.pipeline,
        )
        self._last_compute = record.compute_s - slept
        return record

    def sampled(self, step: int) -> bool:
        """Steps 0 and 1, every ``telemetry.comm_sample_every``-th, and this process's first."""
        every = self.config.telemetry.comm_sample_every
        return not self.recorder.records or step < 2 or step % every == 0

    def _count_memory(
        self, strategy: TrainingStrategy, optimizer: torch.optim.Optimizer, params_peak: int
    ) -> None:
        """This rank's model state and the tracked activations' peak, kept for the steps until
        the next sample: model state changes size only when the optimizer creates its state,
        and iterating every shard costs a few ms. Call before the gradients go. A new dict each
        time: the step records keep the one of their sample."""
        self._memory = model_state_bytes(strategy.model, optimizer)
        self._memory["params"] = max(self._memory["params"], params_peak)
        self._memory["activations"] = self._activations.peak_bytes

    def _simulate_straggler(self) -> float:
        """Stretch this rank's compute to FACTOR x its own (the last step's, unslowed), before
        its gradients can reach the all-reduce. Returns the seconds slept."""
        straggler = self.config.telemetry.simulate_straggler
        if straggler is None or straggler[0] != self.rank:
            return 0.0
        delay = self._last_compute * (straggler[1] - 1)
        time.sleep(delay)
        return delay
