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
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import Dataset

from distml.comm.accounting import CommAccounting
from distml.config import RunConfig, config_from_env
from distml.data.loader import ShardedLoader
from distml.data.sampler import ClaimedBatchSampler
from distml.devices import pick_device
from distml.parallel.data import DataParallel, apply_data_parallel
from distml.parallel.local_sgd import LocalSGD
from distml.parallel.mesh import ParallelDims
from distml.runtime.progress import Progress
from distml.runtime.run_files import write_run_files
from distml.telemetry.energy import open_energy_meter
from distml.telemetry.memory import ActivationTracker, ParameterPeak, model_state_bytes
from distml.telemetry.recorder import StepRecord, StepRecorder
from distml.telemetry.run_record import RunRecord
from distml.train import checkpoint as ckpt
from distml.train.evaluate import Metric, evaluate

if TYPE_CHECKING:
    from distml.parallel.layout import Loss, ModelParallel
    from distml.ps.worker import ParameterServerWorker


def _split(batch: Any, parts: int) -> list[Any]:
    """Split a tensor, or a tuple/list of tensors, into ``parts`` micro-batches along dim 0."""
    if isinstance(batch, torch.Tensor):
        return list(torch.tensor_split(batch, parts))
    columns = [torch.tensor_split(t, parts) for t in batch]
    return [type(batch)(col[i] for col in columns) for i in range(parts)]


def _batch_len(batch: Any) -> int:
    return len(batch if isinstance(batch, torch.Tensor) else batch[0])


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    return type(batch)(_to(t, device) for t in batch)


class Context:
    """Rank, world, device, mesh and seed of one worker, and the run it belongs to."""

    def __init__(
        self,
        config: RunConfig,
        device: torch.device,
        mesh: DeviceMesh,
        dims: ParallelDims,
        rank: int | None = None,
        world_size: int | None = None,
    ):
        self.config = config
        self.rank = dist.get_rank() if rank is None else rank
        self.world_size = dist.get_world_size() if world_size is None else world_size
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.device = device
        self.mesh = mesh
        self.dims = dims
        self.data_rank = self.rank if self.ps else dims.data_rank(self.rank)
        self.data_world = self.world_size if self.ps else dims.data_parallel
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
        self._last_compute = 0.0
        self._scaler: torch.amp.GradScaler | None = None
        self._strategy: DataParallel | LocalSGD | ModelParallel | ParameterServerWorker | None
        self._strategy = None
        self._activations = ActivationTracker()
        self._comm_sample: StepRecord | None = None  # the last step whose collectives were seen
        self._memory: dict[str, int] | None = None  # the last sampled step's memory

    @property
    def model(self) -> nn.Module | None:
        """The model as the strategy wraps it: DDP, the plain module for Local SGD, or what this
        rank holds of a sharded or split one (under the plain model's parameter names)."""
        return self._strategy.model if self._strategy is not None else None

    @property
    def model_parallel(self) -> bool:
        return self._strategy is not None and self.dims.model_parallel

    @property
    def ps(self) -> bool:
        """A parameter-server worker: no process group with the other workers; the servers
        hold the parameters and the optimizer."""
        return self.config.strategy.name == "ps"

    # -- creation ---------------------------------------------------------------------------
    @classmethod
    def create(cls, config: RunConfig | None = None) -> Context:
        """Join the run: read the launcher's environment, start the process group, seed.

        Without a launcher (plain ``python``), this process is a world of one.
        """
        config = (
            config
            or config_from_env()
            or RunConfig(run_name=os.environ.get("DISTML_RUN_NAME") or RunConfig().run_name)
        )
        ps = config.strategy.name == "ps"
        device, backend = pick_device(
            int(os.environ.get("LOCAL_RANK", 0)),
            int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
            grouped=not ps,
        )
        timeout = timedelta(seconds=config.timeout_s)
        if not dist.is_initialized():
            if "WORLD_SIZE" in os.environ and not ps:
                dist.init_process_group(backend, timeout=timeout)
            else:
                store = dist.HashStore()
                dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
        dims = ParallelDims.from_mesh(config.mesh, dist.get_world_size())
        mesh = dims.build_mesh(device.type)
        seed_everything(config.seed)  # identical on every rank: replicas start identical
        if ps:  # workers of a parameter server are a world of one each, and know their rank
            world = int(os.environ.get("WORLD_SIZE", 1))
            return cls(config, device, mesh, dims, int(os.environ.get("RANK", 0)), world)
        return cls(config, device, mesh, dims)

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
        if self.ps and self._strategy is not None:
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
        Local SGD / DiLoCo (``--strategy local-sgd:H``), or the layout of a mesh with ``fsdp``,
        ``tp`` or ``pp`` (:mod:`distml.parallel.layout`). Build ``optimizer`` on the plain
        model; under a model-parallel layout the one returned is its twin over the sharded
        parameters. Without an optimizer, the model is laid out for inference."""
        cfg = self.config.strategy
        if cfg.mixed_precision == "fp16" and self.device.type != "cuda":
            raise ValueError("fp16 mixed precision needs a CUDA device; use bf16 on the CPU")
        model = model.to(self.device)
        if self.dims.model_parallel:
            # Imported here: the layouts bring DTensor and the pipelining package, seconds of
            # start-up that a data-parallel worker does not need.
            from distml.parallel.layout import apply_layout

            self._strategy, optimizer = apply_layout(
                model, optimizer, self.dims, self.mesh, self.config, self.device
            )
        elif self.ps:
            from distml.ps.worker import ParameterServerWorker, servers_from_env

            if optimizer is None:
                raise ValueError("a parameter-server worker needs the optimizer the servers apply")
            urls, token = servers_from_env()
            # Beats well inside the shards' timeout, so that a live worker is never taken for gone.
            beat = min(2.0, self.config.ps.heartbeat_timeout_s / 4)
            self._strategy = ParameterServerWorker(
                model,
                optimizer,
                self.rank,
                urls,
                token,
                self.recorder,
                heartbeat_s=beat,
                consistency=self.config.ps.consistency,
            )
            self.step = self._strategy.start_step  # a restarted worker resumes at its clock
        elif cfg.name == "local-sgd":
            self._strategy = LocalSGD(model, cfg, self.recorder)
        else:
            self._strategy = apply_data_parallel(model, cfg, self.device, self.recorder)
        self.optimizer = optimizer
        if cfg.mixed_precision == "fp16":
            self._scaler = torch.amp.GradScaler("cuda")
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
        claim = self._claim if self.ps and self.config.ps.consistency != "bsp" else None
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
        locally (DDP ``no_sync``) and are all-reduced once, on the last: the same gradient as the
        whole batch at once, with 1/K of the activation memory.
        """
        if self.model is None or self.optimizer is None:
            raise RuntimeError("call ctx.setup(model, optimizer) before ctx.train_step")
        if (compute_loss is None) == (loss is None):
            raise TypeError("give ctx.train_step either compute_loss or loss=, not both")
        if self.model_parallel:
            return self._layout_step(batch, loss, compute_loss)
        if compute_loss is None:
            model = self.model

            def compute_loss(b: Any) -> torch.Tensor:
                return loss(model(b[0]), b[1])

        cfg = self.config.strategy
        rec = self.recorder
        rec.begin_step()
        slept = self._simulate_straggler()
        batch = _to(batch, self.device)
        total = _batch_len(batch)
        parts = min(cfg.grad_accum, total)
        micro_batches = _split(batch, parts) if parts > 1 else [batch]
        # Memory is counted as under a layout: on sampled steps, repeated in between. A
        # parameter-server worker holds no optimizer state of its own.
        sampled = not self.ps and (self._memory is None or self._sampled_step())
        if sampled:
            self._activations.reset()
        activations = self._activations if sampled else nullcontext()
        with activations:
            losses = self._accumulate(micro_batches, compute_loss, total)
        self._strategy.after_backward()
        backward_done = time.perf_counter()
        if self.ps:  # the servers step; this worker pushes and pulls
            rec.add_exposed(self._strategy.step(self.step))
        elif self._scaler is not None:
            self._scaler.step(self.optimizer)
            self._scaler.update()
        else:
            self.optimizer.step()
        if sampled:
            self._count_memory()
        self.optimizer.zero_grad(set_to_none=True)
        rec.add_exposed(self._strategy.after_optimizer_step())
        value = float(sum(losses)) if parts > 1 else losses[0].item()
        record = rec.end_step(self.step, value, total, backward_done, memory=self._memory)
        self._last_compute = record.compute_s - slept
        self.step += 1
        self._progress.update(self.step, value, total * self.world_size / max(record.step_s, 1e-9))
        return value

    def _accumulate(
        self, micro_batches: list[Any], compute_loss: Callable[[Any], torch.Tensor], total: int
    ) -> list[torch.Tensor]:
        """Forward and backward of each micro-batch, DDP synchronising on the last only; the
        micro-batches' losses, each weighted by its share of the batch when there are several."""
        parts = len(micro_batches)
        losses = []
        for i, micro in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with nullcontext() if last else self._strategy.no_sync():
                with self._autocast():
                    loss = compute_loss(micro)
                if parts > 1:  # weight by size: micro-batches of a split may differ by one
                    loss = loss * (_batch_len(micro) / total)
                if self._scaler is not None:
                    self._scaler.scale(loss).backward()
                else:
                    loss.backward()
                losses.append(loss.detach())
        return losses

    def _count_memory(self, params_peak: int = 0) -> None:
        """This rank's model state and the tracked activations' peak, kept for the steps until
        the next sample: model state changes size only when the optimizer creates its state,
        and iterating every shard costs a few ms. Call before the gradients go. A new dict each
        time: the step records keep the one of their sample."""
        self._memory = model_state_bytes(self.model, self.optimizer)
        self._memory["params"] = max(self._memory["params"], params_peak)
        self._memory["activations"] = self._activations.peak_bytes

    def _sampled_step(self) -> bool:
        """Steps 0 and 1 and every ``telemetry.comm_sample_every``-th."""
        return self.step < 2 or self.step % self.config.telemetry.comm_sample_every == 0

    def _layout_step(self, batch: Any, loss: Loss | None, compute_loss: Callable | None) -> float:
        """A step under a model-parallel layout. On the steps ``telemetry.comm_sample_every``
        picks (and steps 0 and 1) every collective is intercepted as it happens, the saved
        activations are tracked and the model state is counted before the gradients go, the
        parameters at their largest (the end of a forward, under ZeRO-2).

        Intercepting means a Python dispatch mode that sees every operator (about a third of a
        small model's step on the CPU), so it samples: a fixed layout and batch shape move the
        same bytes and hold the same memory every step, and the steps between samples repeat
        the last sample's bytes, memory and share of the step spent blocked in communication
        (``comm_measured: false``).
        """
        rec = self.recorder
        rec.begin_step()
        slept = self._simulate_straggler()
        batch = _to(batch, self.device)
        strategy: ModelParallel = self._strategy
        sampled = self._sampled_step() or self._comm_sample is None
        comm = CommAccounting(rec.add_comm) if sampled else nullcontext()
        # Saved-tensor hooks on every activation cost as much as a few percent of a step: the
        # activations' peak is measured on the sampled steps too, and repeated in between.
        activations = self._activations if sampled else nullcontext()
        params = ParameterPeak(self.model) if sampled else nullcontext()
        if sampled:
            self._activations.reset()
        with comm, activations, params:
            value = strategy.forward_backward(batch, loss, compute_loss, self._autocast, _split)
            backward_done = time.perf_counter()
            self.optimizer.step()
        if sampled:
            rec.add_exposed(comm.blocked_s)
        else:
            rec.repeat_comm(self._comm_sample, backward_done)
        if sampled:
            self._count_memory(params.peak_bytes)
        self.optimizer.zero_grad(set_to_none=True)
        pipeline = (strategy.busy_s, strategy.span_s) if strategy.stages else None
        total = _batch_len(batch)
        record = rec.end_step(
            self.step, value, total, backward_done, memory=self._memory, pipeline=pipeline
        )
        if sampled:
            self._comm_sample = record
        self._last_compute = record.compute_s - slept
        self.step += 1
        samples_per_s = total * self.data_world / max(record.step_s, 1e-9)
        self._progress.update(self.step, value, samples_per_s)
        return value

    def _autocast(self):
        precision = self.config.strategy.mixed_precision
        if precision == "fp32" or (self.model_parallel and self._strategy.fsdp):
            return nullcontext()  # FSDP's mixed-precision policy casts the parameters itself
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    def _simulate_straggler(self) -> float:
        """Stretch this rank's compute to FACTOR x its own (the last step's, unslowed), before
        its gradients can reach the all-reduce. Returns the seconds slept."""
        straggler = self.config.telemetry.simulate_straggler
        if straggler is None or straggler[0] != self.rank:
            return 0.0
        delay = self._last_compute * (straggler[1] - 1)
        time.sleep(delay)
        return delay

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
        if self.model_parallel:
            return evaluate(
                self.model,
                dataset,
                metrics,
                device=self.device,
                batch_size=batch_size,
                group=self._strategy.data_group,
                forward=self._strategy.forward,
                shard=(self.data_rank, self.data_world),
            )
        module = model.module if hasattr(model, "module") else model
        return evaluate(module, dataset, metrics, device=self.device, batch_size=batch_size)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The whole model's output for ``x`` on every rank, whatever the layout (all ranks of
        the run call it with the same ``x``)."""
        if self.model_parallel:
            return self._strategy.forward(x.to(self.device))
        return self._module()(x.to(self.device))

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
        if self.ps:
            return self._strategy.snapshot()[0].parent
        return ckpt.save_checkpoint(
            self.checkpoint_dir, self.step, self._module(), self.optimizer, self._extra_state()
        )

    def load_checkpoint(self, path: Path | None = None) -> bool:
        """Resume from ``path`` or this run's latest checkpoint; False if there is none.

        A parameter-server worker resumes from the servers: its step is its clock there, and its
        loaders of fixed shards move past the batches of the steps it already pushed (loaders that
        claim batches need not: the servers hand out only what is left)."""
        if self.ps:
            for loader in self.loaders:
                if isinstance(loader.sampler, ClaimedBatchSampler):
                    continue  # the servers know the epoch: those used up answer "none" at once
                per_epoch = max(len(loader), 1)
                loader.load_state_dict(
                    {"epoch": self.step // per_epoch, "position": self.step % per_epoch}
                )
            return self.step > 0
        path = path or ckpt.latest_checkpoint(self.checkpoint_dir)
        if path is None:
            return False
        extra = self._extra_state()
        keys = ckpt.checkpoint_keys(path)
        extra = {k: v for k, v in extra.items() if f"extra.{k}" in keys}  # another world size
        extra = ckpt.load_checkpoint(path, self._module(), self.optimizer, extra)
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
        if self.model_parallel:
            return ckpt.gather_full_state(self.model, self.stage_leaders())
        if dist.get_rank() != 0:
            return None
        module = self._module()
        state = {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
        return state, {name for name, _ in module.named_parameters()}

    def stage_leaders(self) -> list[int]:
        """One global rank per pipeline stage: the first of each pp slice of the grid."""
        per_stage = self.world_size // self.dims.pp
        return [k * per_stage for k in range(self.dims.pp)]

    def _module(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError("call ctx.setup(model, optimizer) first")
        return self.model.module if hasattr(self.model, "module") else self.model

    # -- the end ----------------------------------------------------------------------------
    def finish(self, eval: dict[str, float] | None = None) -> dict[str, Any]:
        """Gather every rank's measurements and write the run directory. Returns the summary."""
        self._progress.stop()
        if self.ps:
            from distml.jobs.ps import write_worker_files  # the web stack: parameter servers only

            self._strategy.finalize()
            return write_worker_files(self._record(), eval or {})
        return write_run_files(self._record(), eval or {})

    def _record(self) -> RunRecord:
        """This rank's run as plain data for the run files. Under model parallelism it gathers
        the whole state from every rank's shards: a collective, which every rank calls."""
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
            mesh=self.dims.as_dict() if self.model_parallel else {"dp": self.world_size},
            model_parallel=self.model_parallel,
            module=None if self.model is None else self._module(),
            full_state=self.full_state_dict() if self.model_parallel else None,
        )


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
