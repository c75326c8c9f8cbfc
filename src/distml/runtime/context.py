"""The view a worker has of its run: who it is, where it computes, and the run's services.

>>> import distml
>>> def work(ctx):                       # runs in every worker
...     model, opt = ctx.setup(model, opt)
...     for x, y in ctx.dataloader(train, batch_size=32):
...         ctx.train_step((x, y), lambda b: loss_fn(model(b[0]), b[1]))
...     return ctx.finish(eval=ctx.evaluate(model, val))
>>> distml.launch(work, nproc=2)  # doctest: +SKIP

The same body runs under ``distml run`` (``Context.create()`` at the top of a script), under plain
``torchrun``, and as one plain ``python`` process (a world of one).
"""

from __future__ import annotations

import gc
import os
import random
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import Dataset

from distml.config import RunConfig, config_from_env
from distml.data.loader import ShardedLoader
from distml.devices import pick_device
from distml.layout import Layout
from distml.parallel.mesh import build_mesh
from distml.parallel.precision import MixedPrecision
from distml.parallel.registry import strategy_for
from distml.parallel.strategy import (
    Loss,
    Objective,
    RecordFields,
    StrategyEnv,
    TrainingStrategy,
    evaluate_replica,
)
from distml.runtime.progress import Progress
from distml.runtime.run_files import write_run_files
from distml.runtime.step import StepLoop
from distml.telemetry.energy import open_energy_meter
from distml.telemetry.recorder import StepRecorder
from distml.telemetry.run_record import RunRecord
from distml.train.evaluate import Metric


class Context:
    """Rank, world, device, mesh and seed of one worker, and the run it belongs to.

    The run's training strategy (:mod:`distml.parallel.registry`, by ``strategy.name`` and the
    mesh) is picked once, here; the Context drives it through
    :class:`distml.parallel.strategy.TrainingStrategy` alone.
    """

    def __init__(
        self,
        config: RunConfig,
        device: torch.device,
        mesh: DeviceMesh,
        layout: Layout,
        rank: int | None = None,
        world_size: int | None = None,
        strategy: type[TrainingStrategy] | None = None,
    ):
        self.config = config
        self.rank = dist.get_rank() if rank is None else rank
        self.world_size = dist.get_world_size() if world_size is None else world_size
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.device = device
        self.mesh = mesh
        self.layout = layout
        self._strategy_class = strategy or strategy_for(config)
        self.data_rank, self.data_world = self._strategy_class.data_shard(
            self.rank, self.world_size, layout
        )
        self.run_dir = config.run_dir
        self.attempt = int(os.environ.get("DISTML_ATTEMPT", 0))
        self.step = 0
        energy = open_energy_meter(
            device.type, device.index or 0, self.local_rank, config.telemetry.watts_per_cpu_core
        )
        self.recorder = StepRecorder(self.rank, device, energy)
        self.optimizer: torch.optim.Optimizer | None = None
        self.loaders: list[ShardedLoader] = []
        self._progress = Progress(enabled=self.rank == 0 and config.telemetry.progress)
        self._started = time.perf_counter()
        self._steps = StepLoop(config, self.rank, device, self.recorder)
        self._strategy: TrainingStrategy | None = None

    @property
    def model(self) -> nn.Module | None:
        """The model as the strategy wraps it: DDP, the plain module for Local SGD, or what this
        rank holds of a sharded or split one (under the plain model's parameter names)."""
        return self._strategy.model if self._strategy is not None else None

    # -- creation ---------------------------------------------------------------------------
    @classmethod
    def create(cls, config: RunConfig | None = None) -> Context:
        """Join the run: read the launcher's environment, start the process group, seed.

        Without a launcher (plain ``python``), this process is a world of one; so is each worker
        of a strategy whose workers share no process group (a parameter server's), which still
        knows its rank among the launcher's workers.
        """
        config = (
            config
            or config_from_env()
            or RunConfig(run_name=os.environ.get("DISTML_RUN_NAME") or RunConfig().run_name)
        )
        strategy = strategy_for(config)
        grouped = strategy.joins_process_group
        device, backend = pick_device(
            int(os.environ.get("LOCAL_RANK", 0)),
            int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
            grouped=grouped,
        )
        timeout = timedelta(seconds=config.timeout_s)
        if not dist.is_initialized():
            if "WORLD_SIZE" in os.environ and grouped:
                dist.init_process_group(backend, timeout=timeout)
            else:
                store = dist.HashStore()
                dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
        layout = Layout.from_mesh(config.mesh, dist.get_world_size(), config.parallel)
        mesh = build_mesh(layout, device.type)
        seed_everything(config.seed)  # identical on every rank: replicas start identical
        if grouped:
            return cls(config, device, mesh, layout, strategy=strategy)
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        return cls(config, device, mesh, layout, rank, world, strategy=strategy)

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Leave the run. Drops the DDP model first, while the process group is still alive.

        Otherwise the model is freed at interpreter exit, its reducer holds the last reference to
        the gloo group, and the group's destructor joins gloo's threads while holding the GIL;
        a thread that is still releasing a Python future callback waits for that GIL forever.
        """
        self._progress.stop()
        if self._strategy is not None:
            self._strategy.close()
        if not dist.is_initialized():
            return
        dist.barrier()
        self._strategy = None  # the only reference distml keeps to the DDP model
        self.optimizer = None
        gc.collect()
        time.sleep(0.05)  # GIL released: gloo's threads finish releasing their callbacks
        dist.destroy_process_group()

    # -- training ---------------------------------------------------------------------------
    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        """Apply the run's strategy to ``model``: synchronous data parallelism through DDP,
        Local SGD / DiLoCo (``--strategy local-sgd:H``), a parameter-server worker
        (``--strategy ps``), or the layout of a mesh with ``fsdp``, ``tp`` or ``pp``
        (:mod:`distml.parallel.layout`). Build ``optimizer`` on the plain model; under a
        model-parallel layout the one returned is its twin over the sharded parameters.
        Without an optimizer, the model is laid out for inference."""
        precision = MixedPrecision(self.config.strategy.mixed_precision, self.device)
        env = StrategyEnv(
            config=self.config,
            rank=self.rank,
            world_size=self.world_size,
            device=self.device,
            layout=self.layout,
            mesh=self.mesh,
            recorder=self.recorder,
            precision=precision,
        )
        self._strategy, optimizer = self._strategy_class.apply(
            model.to(self.device), optimizer, env
        )
        self.optimizer = optimizer
        self.step = self._strategy.start_step  # a restarted PS worker resumes at its clock
        seed_everything(self.config.seed + self.rank)  # from here on, ranks draw differently
        return self.model, optimizer

    def dataloader(
        self, dataset: Dataset, batch_size: int, *, shuffle: bool = True, **kwargs: Any
    ) -> ShardedLoader:
        """This rank's shard of ``dataset``, ``batch_size`` samples per step; resumable.

        Under an asynchronous parameter server (ASP, SSP) the rank has no fixed shard: it claims
        batches of the shared epoch order from the servers, so a fast rank trains on more of them.
        See :mod:`distml.data.sampler` for the rule on sizes that do not divide.
        """
        claim = self._claim if self._strategy_class.claims_batches(self.config) else None
        loader = ShardedLoader(
            dataset,
            batch_size,
            self.data_rank,
            self.data_world,
            shuffle=shuffle,
            seed=self.config.seed,
            claim=claim,
            **kwargs,
        )
        self.loaders.append(loader)
        return loader

    def _claim(self, epoch: int, position: int, batches: int) -> int | None:
        if self._strategy is None:
            raise RuntimeError("call ctx.setup(model, optimizer) before iterating the dataloader")
        return self._strategy.claim(epoch, position, batches)

    def train_step(
        self,
        batch: Any,
        compute_loss: Callable[[Any], torch.Tensor] | None = None,
        *,
        loss: Loss | None = None,
    ) -> float:
        """One optimizer step on ``batch``; returns the batch's mean loss on this rank.

        Give either ``compute_loss(batch) -> loss`` or, for ``batch = (inputs, targets)``,
        ``loss(model(inputs), targets)``; pipeline parallelism needs the second form, since the
        output exists only on the last stage.

        With ``grad_accum = K`` the batch is cut into K micro-batches whose gradients accumulate
        locally (DDP ``no_sync``) and are reduced once, on the last: the same gradient as the
        whole batch at once, with 1/K of the activation memory (:mod:`distml.runtime.step`).
        """
        strategy = self._strategy
        if strategy is None or self.optimizer is None:
            raise RuntimeError("call ctx.setup(model, optimizer) before ctx.train_step")
        if (compute_loss is None) == (loss is None):
            raise TypeError("give ctx.train_step either compute_loss or loss=, not both")
        objective = Objective(compute_loss, loss)
        record = self._steps.run(strategy, self.optimizer, batch, objective, self.step)
        self.step += 1
        samples_per_s = record.samples * self.data_world / max(record.step_s, 1e-9)
        self._progress.update(self.step, record.loss, samples_per_s)
        return record.loss

    # -- validation -------------------------------------------------------------------------
    def evaluate(
        self,
        model: nn.Module,
        dataset: Dataset,
        metrics: Mapping[str, Metric] | list[str] | None = None,
        batch_size: int = 256,
    ) -> dict[str, float]:
        """Exact dataset-wide metric means (default: accuracy and loss), on every rank.

        Under a model-parallel layout the whole model's forward runs through the layout, and the
        dataset is split over the data-parallel ranks only."""
        if self._strategy is None:
            return evaluate_replica(model, dataset, metrics, self.device, batch_size)
        return self._strategy.evaluate(model, dataset, metrics, batch_size)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The whole model's output for ``x`` on every rank, whatever the layout (all ranks of
        the run call it with the same ``x``)."""
        return self._require_strategy().forward(x.to(self.device))

    # -- checkpoints ------------------------------------------------------------------------
    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoint"

    def _extra_state(self) -> dict[str, torch.Tensor]:
        extra = {"step": torch.tensor(self.step), f"rng_rank{self.rank}": torch.get_rng_state()}
        for i, loader in enumerate(self.loaders):
            state = loader.state_dict()
            extra[f"loader{i}"] = torch.tensor([state["epoch"], state["position"]])
        return extra

    def save_checkpoint(self) -> Path:
        """Save model, optimizer, step, loader positions and RNG states (all ranks call this).

        Under a parameter server the servers hold the state: each writes its snapshot now."""
        strategy = self._require_strategy()
        return strategy.save_checkpoint(
            self.checkpoint_dir, self.step, self.optimizer, self._extra_state()
        )

    def load_checkpoint(self, path: Path | None = None) -> bool:
        """Resume from ``path`` or this run's latest checkpoint; False if there is none.

        A parameter-server worker resumes from the servers: its step is its clock there, and its
        loaders of fixed shards move past the batches of the steps it already pushed."""
        extra = self._require_strategy().load_checkpoint(
            path, self.checkpoint_dir, self.optimizer, self._extra_state(), self.loaders
        )
        if extra is None:
            return False
        self.step = int(extra["step"])
        if f"rng_rank{self.rank}" in extra:
            torch.set_rng_state(extra[f"rng_rank{self.rank}"])
        for i, loader in enumerate(self.loaders):
            if f"loader{i}" in extra:
                epoch, position = extra[f"loader{i}"].tolist()
                loader.load_state_dict({"epoch": epoch, "position": position})
        return True

    def full_state_dict(self) -> tuple[dict[str, torch.Tensor], set[str]] | None:
        """The whole model's parameters and buffers, unsharded, on the CPU of rank 0 (None on
        the other ranks), and the names among them that are parameters. Every rank calls it."""
        return self._require_strategy().full_state_dict()

    def stage_leaders(self) -> list[int]:
        """One global rank per pipeline stage: the first of each pp slice of the grid."""
        return self.layout.stage_leaders()

    def _require_strategy(self) -> TrainingStrategy:
        if self._strategy is None:
            raise RuntimeError("call ctx.setup(model, optimizer) first")
        return self._strategy

    # -- the end ----------------------------------------------------------------------------
    def finish(self, eval: dict[str, float] | None = None) -> dict[str, Any]:
        """Gather every rank's measurements and write the run directory. Returns the summary."""
        self._progress.stop()
        if self._strategy is not None:
            self._strategy.finish()
        return write_run_files(self._record(), eval or {})

    def _record(self) -> RunRecord:
        """This rank's run as plain data for the run files, with what the strategy adds (under
        model parallelism the whole state, gathered from every rank's shards: a collective,
        which every rank calls)."""
        fields = (
            self._strategy.record_fields()
            if self._strategy is not None
            else RecordFields(mesh={"dp": self.world_size})
        )
        return RunRecord(
            config=self.config,
            rank=self.rank,
            world_size=self.world_size,
            attempt=self.attempt,
            steps=self.step,
            run_dir=self.run_dir,
            device=self.device,
            wall_s=time.perf_counter() - self._started,
            recorder=self.recorder,
            shares_process_group=self._strategy_class.joins_process_group,
            **fields,
        )


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        np.random.seed(seed % 2**32)
    except ImportError:
        pass
