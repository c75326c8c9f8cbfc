"""The one protocol every training strategy implements, and what it is applied with.

A strategy is applied to a plain model from outside: DDP (:mod:`distml.parallel.data`), Local
SGD / DiLoCo (:mod:`distml.parallel.local_sgd`), a model-parallel layout
(:mod:`distml.parallel.layout`), a parameter-server worker (:mod:`distml.ps.worker`). Each is
registered by name (:mod:`distml.parallel.registry`), and
:class:`distml.runtime.context.Context` drives whichever it holds through this protocol only,
in one step loop (:mod:`distml.runtime.step`)::

    with strategy.traced(trace):                       # what it measures of the step
        for micro, weight, last in micro_batches:      # grad_accum, cut by the loop alone
            loss = strategy.forward_backward(micro, objective, weight, last)
        strategy.after_backward()                      # gradients handed to the network
        exposed_s = strategy.step(optimizer, step)     # the update, and what it waited for

Outside the step a strategy saves and loads checkpoints, evaluates, gathers the whole model and
adds to the run's record. The defaults below are those of a strategy whose ranks each hold the
whole model and share nothing: as they stand, every rank trains alone. A new strategy overrides
what it changes, in its own module, and adds one line to the registry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypedDict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import Dataset

from distml.config import RunConfig
from distml.data.loader import ShardedLoader
from distml.layout import Layout
from distml.parallel.precision import MixedPrecision
from distml.telemetry.recorder import StepRecorder
from distml.train import checkpoint as ckpt
from distml.train.evaluate import Metric, evaluate

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Objective:
    """What a step minimises: ``compute_loss(batch)``, or ``loss(model(inputs), targets)`` for
    ``batch = (inputs, targets)``, the form a pipeline needs (the output exists only on its
    last stage)."""

    compute_loss: Callable[[Any], torch.Tensor] | None = None
    loss: Loss | None = None

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        if self.compute_loss is not None:
            return self.compute_loss(batch)
        return self.loss(model(batch[0]), batch[1])


@dataclass(frozen=True)
class StrategyEnv:
    """Where a strategy is applied: the run, this rank in its world and mesh, the device, where
    communication is reported, and the run's mixed precision."""

    config: RunConfig
    rank: int
    world_size: int
    device: torch.device
    layout: Layout
    mesh: DeviceMesh
    recorder: StepRecorder
    precision: MixedPrecision


@dataclass
class StepTrace:
    """One step, as seen around it. Context sets ``sampled`` (the steps whose memory and, where
    a strategy intercepts them, collectives are measured) and ``backward_done``; a strategy
    fills in what it measured."""

    sampled: bool
    backward_done: float = 0.0
    params_peak: int = 0  # bytes of parameters at their largest during the step; 0: not seen
    pipeline: tuple[float, float] | None = None  # a pipeline's (stages busy, schedule span) s


class RecordFields(TypedDict, total=False):
    """What a strategy adds to its rank's :class:`distml.telemetry.run_record.RunRecord`."""

    mesh: dict[str, int]
    module: nn.Module | None  # the whole plain model, where this rank holds it
    full_state: tuple[dict[str, torch.Tensor], set[str]] | None  # gathered, on rank 0
    summary: dict[str, Any]  # what it adds to summary.json


class TrainingStrategy:
    """A strategy applied to one rank's model; see the module's docstring for the step loop."""

    joins_process_group: ClassVar[bool] = True
    """False: each worker is a world of one, coordinated by what the strategy's job starts
    beside the workers (parameter servers). The launcher's ranks are then the data ranks, and
    each worker writes its own records for that job to gather."""

    counts_memory: ClassVar[bool] = True
    """False where the rank holds no training state of its own to count (the servers do)."""

    def __init__(self, model: nn.Module, env: StrategyEnv):
        self.model = model  # as the strategy wraps it: what ctx.model returns
        self.env = env
        self.precision = env.precision
        self.start_step = 0  # where this rank resumes without a checkpoint

    @classmethod
    def apply(
        cls,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        env: StrategyEnv,
    ) -> tuple[TrainingStrategy, torch.optim.Optimizer | None]:
        """Apply the strategy to ``model`` (already on the device), with ``optimizer`` built on
        it; returns the strategy and the optimizer to step (a layout's is a twin over its
        sharded parameters). Without an optimizer, the model is laid out for inference."""
        return cls(model, env), optimizer

    @classmethod
    def data_shard(cls, rank: int, world_size: int, layout: Layout) -> tuple[int, int]:
        """Which of how many different batches of a step ``rank`` reads."""
        if not cls.joins_process_group:
            return rank, world_size
        return layout.data_rank(rank), layout.data_parallel

    @classmethod
    def claims_batches(cls, config: RunConfig) -> bool:
        """True where the rank has no fixed shard and claims each batch (:meth:`claim`)."""
        return False

    @property
    def module(self) -> nn.Module:
        """The plain model under the strategy's wrapper, with its own parameter names."""
        return self.model

    # -- the step -----------------------------------------------------------------------------
    def traced(self, trace: StepTrace) -> AbstractContextManager[None]:
        """Around the step's forward, backward and update: what the strategy measures beyond
        its hooks' reports. Nothing by default."""
        return nullcontext()

    def no_sync(self) -> AbstractContextManager[None]:
        """Around every micro-batch but the last: gradients accumulate locally."""
        return nullcontext()

    def forward_backward(
        self, batch: Any, objective: Objective, weight: float, last: bool
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch, its loss weighted by ``weight`` (its share
        of the step's batch); returns that weighted loss, detached."""
        with nullcontext() if last else self.no_sync():
            with self.precision.autocast():
                loss = objective(self.model, batch)
            if weight != 1.0:
                loss = loss * weight
            self.precision.backward(loss)
        return loss.detach()

    def after_backward(self) -> None:
        """The step's gradients are computed and handed to the network."""
        self.env.recorder.grads_ready()

    def step(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        """Apply this step's gradients; returns the seconds of communication the update waited
        for outside backward."""
        self.precision.step(optimizer)
        return 0.0

    def claim(self, epoch: int, position: int, batches: int) -> int | None:
        """The next unclaimed batch of ``epoch``; only where :meth:`claims_batches`."""
        raise NotImplementedError(f"{type(self).__name__} reads a fixed shard of each epoch")

    # -- outside the step ---------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The whole model's output for ``x``, on every rank (all call it with the same ``x``)."""
        return self.module(x)

    def evaluate(
        self,
        model: nn.Module,
        dataset: Dataset,
        metrics: Mapping[str, Metric] | list[str] | None,
        batch_size: int,
    ) -> dict[str, float]:
        """Exact dataset-wide metric means of ``model`` (the user's handle on it), on every
        rank."""
        return evaluate_replica(model, dataset, metrics, self.env.device, batch_size)

    def full_state_dict(self) -> tuple[dict[str, torch.Tensor], set[str]] | None:
        """The whole model's parameters and buffers on the CPU of rank 0 (None elsewhere), and
        the names among them that are parameters. Every rank calls it."""
        if dist.get_rank() != 0:
            return None
        state = {k: v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()}
        return state, {name for name, _ in self.module.named_parameters()}

    def save_checkpoint(
        self,
        directory: Path,
        step: int,
        optimizer: torch.optim.Optimizer,
        extra: dict[str, torch.Tensor],
    ) -> Path:
        """Save model, optimizer and ``extra`` (every rank calls it); the checkpoint's path."""
        return ckpt.save_checkpoint(directory, step, self.module, optimizer, extra)

    def load_checkpoint(
        self,
        path: Path | None,
        directory: Path,
        optimizer: torch.optim.Optimizer,
        extra: dict[str, torch.Tensor],
        loaders: Sequence[ShardedLoader],
    ) -> dict[str, torch.Tensor] | None:
        """Restore model and optimizer from ``path`` (or ``directory``'s latest); returns what
        it restored of ``extra`` (``step``, and where known RNG and ``loader{i}`` positions),
        None if there is nothing to resume from. ``loaders`` are this rank's."""
        path = path or ckpt.latest_checkpoint(directory)
        if path is None:
            return None
        keys = ckpt.checkpoint_keys(path)
        extra = {k: v for k, v in extra.items() if f"extra.{k}" in keys}  # another world size
        return ckpt.load_checkpoint(path, self.module, optimizer, extra)

    def record_fields(self) -> RecordFields:
        """What this rank adds to its run record; every rank calls it (a collective where the
        model is sharded)."""
        return {"mesh": {"dp": self.env.world_size}, "module": self.module}

    def finish(self) -> None:
        """Training is over, before the run files are written."""

    def close(self) -> None:
        """The rank leaves the run: release what the strategy holds outside torch."""


def evaluate_replica(
    model: nn.Module,
    dataset: Dataset,
    metrics: Mapping[str, Metric] | list[str] | None,
    device: torch.device,
    batch_size: int,
) -> dict[str, float]:
    """Evaluate a model every rank holds whole (unwrapped from DDP), each rank a block."""
    module = model.module if hasattr(model, "module") else model
    return evaluate(module, dataset, metrics, device=device, batch_size=batch_size)
