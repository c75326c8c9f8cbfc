"""A layout on the mesh pp x dp x fsdp x tp, applied to a plain model in one visible order.

``apply_layout`` does what torchtitan's ``parallelize_llama`` does: cut the pipeline stages first,
then on what this rank keeps apply tensor parallelism, then activation checkpointing, then FSDP
(HSDP when ``dp`` > 1 too). The result, :class:`ModelParallel`, is the training strategy of
such a mesh: one step's forward and backward (through a pipeline schedule when ``pp`` > 1), its
collectives intercepted on sampled steps, a forward for evaluation and generation, and the whole
state gathered from every rank's shards.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from distml.comm.accounting import CommAccounting
from distml.config import ConfigError
from distml.parallel.activation_checkpoint import checkpoint_blocks
from distml.parallel.pipeline import (
    SCHEDULES,
    PipelinePlan,
    TimedStage,
    build_stages,
    forward_through_stages,
    pipeline_bubble,
    refresh_views,
)
from distml.parallel.precision import MixedPrecision
from distml.parallel.sharded import apply_fsdp
from distml.parallel.strategy import (
    Loss,
    Objective,
    RecordFields,
    StepTrace,
    StrategyEnv,
    TrainingStrategy,
)
from distml.parallel.tensor import apply_tensor_parallel, resolve_tp_plan
from distml.telemetry.memory import ParameterPeak
from distml.train.checkpoint import gather_full_state
from distml.train.evaluate import Metric, evaluate

_WRAPPED = "_checkpoint_wrapped_module."


def parameter_names(model: nn.Module) -> dict[str, nn.Parameter]:
    """Parameters by the name they have in the plain model (wrappers' prefixes removed)."""
    return {name.replace(_WRAPPED, ""): p for name, p in model.named_parameters()}


def rebuild_optimizer(
    optimizer: torch.optim.Optimizer, old_names: dict[int, str], model: nn.Module
) -> torch.optim.Optimizer:
    """The same optimizer class and param groups over ``model``'s new (sharded) parameters.

    FSDP and DTensor replace parameters by new objects, so an optimizer built on the plain model
    would update tensors nobody uses. Groups are matched by parameter name; a parameter this rank
    does not hold (another pipeline stage's) is left out.
    """
    if optimizer.state:
        raise ConfigError("ctx.setup needs an optimizer that has not stepped yet")
    new = parameter_names(model)
    if any(id(p) not in old_names for g in optimizer.param_groups for p in g["params"]):
        raise ValueError(
            "ctx.setup: the optimizer holds tensors that are not the model's parameters"
        )
    groups = []
    for group in optimizer.param_groups:
        names = [old_names[id(p)] for p in group["params"]]
        params = [new[n] for n in names if n in new]
        if params:
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    # Every group carries all its hyperparameters; defaults only serve later add_param_group.
    rebuilt = type(optimizer)(groups)
    rebuilt.defaults = dict(optimizer.defaults)
    return rebuilt


class ModelParallel(TrainingStrategy):
    """A model laid out on the mesh, with the step and the forward that the layout needs."""

    def __init__(self, model: nn.Module, env: StrategyEnv, stages: list[TimedStage]):
        super().__init__(model, env)  # what this rank holds, under the plain model's names
        self.layout = env.layout
        self.mesh = env.mesh
        self.config = env.config
        self.device = env.device
        self.stages = stages
        self._schedule: Any = None
        self._schedule_loss: Loss | None = None
        self.span_s = 0.0
        self.pp_group = self.mesh["pp"].get_group() if self.layout.pp > 1 else None
        self.fsdp = self.layout.data_parallel > 1 or self.layout.fsdp > 1
        # FSDP's mixed-precision policy casts the parameters itself, and the layout's optimizer
        # steps on its own (DTensor gradients): no autocast under FSDP, no loss scaling.
        self.precision = MixedPrecision(
            env.config.strategy.mixed_precision,
            env.device,
            autocast=not self.fsdp,
            scale_loss=False,
        )

    @classmethod
    def apply(
        cls,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        env: StrategyEnv,
    ) -> tuple[ModelParallel, torch.optim.Optimizer | None]:
        return apply_layout(model, optimizer, env)

    # -- groups -----------------------------------------------------------------------------
    @property
    def data_group(self) -> dist.ProcessGroup | None:
        """The ranks that see different batches (dp x fsdp); None if there is only one."""
        if self.layout.data_parallel == 1:
            return None
        return self.mesh["dp", "fsdp"]._flatten("data").get_group()

    # -- training ---------------------------------------------------------------------------
    @contextmanager
    def traced(self, trace: StepTrace) -> Iterator[None]:
        """On sampled steps every collective is intercepted as it happens, and the parameters
        are seen at their largest (the end of a forward, under ZeRO-2).

        Intercepting means a Python dispatch mode that sees every operator (about a third of a
        small model's step on the CPU), so it samples: a fixed layout and batch shape move the
        same bytes every step, and the steps between samples repeat the last sample's bytes and
        share of the step spent blocked in communication (``comm_measured: false``).
        """
        recorder = self.env.recorder
        if trace.sampled:
            comm = CommAccounting(recorder.add_comm)
            params = ParameterPeak(self.model)
            with comm, params:
                yield
            recorder.add_exposed(comm.blocked_s)
            trace.params_peak = params.peak_bytes
        else:
            yield
            recorder.repeat_comm(recorder.last_measured(), trace.backward_done)
        if self.stages:
            trace.pipeline = (self.busy_s, self.span_s)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        if not self.fsdp:
            yield
            return
        self.model.set_requires_gradient_sync(False)  # reduce once, with the last micro-batch
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def forward_backward(
        self, batch: Any, objective: Objective, weight: float, last: bool
    ) -> torch.Tensor:
        if self.layout.pp == 1:
            return super().forward_backward(batch, objective, weight, last)
        if objective.loss is None:
            raise ValueError(
                "pipeline parallelism needs ctx.train_step((inputs, targets), loss=fn): "
                "the last stage computes fn(output, targets)"
            )
        return self._pipeline_step(batch, objective.loss) * weight

    def after_backward(self) -> None:
        pass  # the collectives are intercepted (or repeated) by traced(), not inferred

    def _pipeline_step(self, batch: Any, loss: Loss) -> torch.Tensor:
        x, y = batch
        m = self.config.parallel.microbatches
        if len(x) % m:
            raise ValueError(f"a batch of {len(x)} does not split into {m} micro-batches")
        schedule = self._pipeline_schedule(loss)
        ids = [s.stage_index for s in self.stages]
        first, last = 0 in ids, self.stages[0].num_stages - 1 in ids
        losses: list[torch.Tensor] = []
        for stage in self.stages:
            stage.busy_s = 0.0
        start = time.perf_counter()
        with self.precision.autocast():
            args = (x,) if first else ()
            kwargs = {"target": y, "losses": losses} if last else {}
            schedule.step(*args, **kwargs)
        self.span_s = time.perf_counter() - start
        value = torch.stack(losses).mean().detach() if last else torch.zeros((), device=x.device)
        src = dist.get_global_rank(self.pp_group, self.layout.pp - 1)
        dist.broadcast(value, src=src, group=self.pp_group)
        return value

    def _pipeline_schedule(self, loss: Loss) -> Any:
        if self._schedule is None or self._schedule_loss is not loss:
            cls = SCHEDULES[self.config.parallel.schedule]
            stages = (
                self.stages if cls.__name__.startswith("ScheduleInterleaved") else self.stages[0]
            )
            last = self.stages[-1]

            def timed_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
                start = time.perf_counter()  # the loss is the last stage's work too
                try:
                    return loss(output, target)
                finally:
                    last.busy_s += time.perf_counter() - start

            self._schedule = cls(
                stages, n_microbatches=self.config.parallel.microbatches, loss_fn=timed_loss
            )
            self._schedule_loss = loss
        return self._schedule

    @property
    def busy_s(self) -> float:
        """Seconds this rank's stages computed during the last pipeline step (of ``span_s``,
        the schedule's whole run)."""
        return sum(s.busy_s for s in self.stages)

    # -- forward only -----------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The whole model's output for ``x``, on every rank (a collective of the layout).

        Through the pipeline the stages run one after the other on the whole batch: forward-only
        work of any batch size, without the schedule's fixed micro-batch shapes.
        """
        if self.layout.pp == 1:
            return self.model(x)
        pp_rank = self.mesh["pp"].get_local_rank()
        return forward_through_stages(x, self.stages, pp_rank, self.pp_group, self.device)

    def evaluate(
        self,
        model: nn.Module,
        dataset: Dataset,
        metrics: Mapping[str, Metric] | list[str] | None,
        batch_size: int,
    ) -> dict[str, float]:
        """The whole model's forward runs through the layout, and the dataset is split over
        the data-parallel ranks only (their tensor- and pipeline-parallel peers read the same
        block)."""
        return evaluate(
            self.model,
            dataset,
            metrics,
            device=self.device,
            batch_size=batch_size,
            group=self.data_group,
            forward=self.forward,
            shard=(self.layout.data_rank(self.env.rank), self.layout.data_parallel),
        )

    # -- the whole model --------------------------------------------------------------------
    def full_state_dict(self) -> tuple[dict[str, torch.Tensor], set[str]] | None:
        return gather_full_state(self.model, self.layout.stage_leaders())

    def record_fields(self) -> RecordFields:
        """The layout, and the whole state gathered from every rank's shards (a collective)."""
        par = self.config.parallel
        described: dict[str, Any] = {
            **self.layout.as_dict(),
            "activation_checkpointing": par.activation_checkpointing,
            "sequence_parallel": par.sequence_parallel,
            "reshard_after_forward": par.reshard_after_forward,
        }
        summary: dict[str, Any] = {"layout": described}
        if self.layout.pp > 1:
            described.update(
                schedule=par.schedule,
                microbatches=par.microbatches,
                stages_per_rank=par.virtual_stages,
            )
            formula = pipeline_bubble(self.layout.pp, par.microbatches, par.virtual_stages)
            summary["bubble"] = {"measured": None, "formula": formula}
        return {
            "mesh": self.layout.as_dict(),
            "module": None,  # no rank holds the whole model
            "full_state": self.full_state_dict(),
            "summary": summary,
        }


def apply_layout(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, env: StrategyEnv
) -> tuple[ModelParallel, torch.optim.Optimizer | None]:
    """Pipeline stages, then tensor parallelism, then activation checkpointing, then FSDP."""
    config, layout, mesh, device = env.config, env.layout, env.mesh, env.device
    par = config.parallel
    old_names = {id(p): name for name, p in model.named_parameters()}
    tp_plan = resolve_tp_plan(model, par.tp_plan) if par.tp_plan is not None else None
    views: list[nn.Module] = [model]
    ids = [0]
    if layout.pp > 1:
        plan = PipelinePlan(mesh["pp"].get_local_rank(), layout.pp, par.virtual_stages)
        views, ids = build_stages(model, plan, par.split_points)
    if layout.tp > 1:
        apply_tensor_parallel(model, mesh["tp"], tp_plan, par.sequence_parallel)
    blocks = getattr(model, "blocks", None)
    if par.activation_checkpointing != "none":
        if not isinstance(blocks, nn.ModuleDict):
            raise ConfigError("activation checkpointing needs the blocks in a ModuleDict 'blocks'")
        checkpoint_blocks(blocks, par.activation_checkpointing)
        if layout.pp > 1:
            refresh_views(model, views)
    if layout.data_parallel > 1 or layout.fsdp > 1:
        units = list(blocks.values()) if isinstance(blocks, nn.ModuleDict) else []
        # HSDP (2-D: replicate x shard) only when there are replicas to all-reduce across.
        data_mesh = mesh["dp", "fsdp"] if layout.dp > 1 else mesh["fsdp"]
        for view in views:
            view_units = [b for b in units if any(b is v for v in view.blocks.values())]
            apply_fsdp(
                view,
                view_units,
                data_mesh,
                reshard_after_forward=par.reshard_after_forward,
                mixed_precision=config.strategy.mixed_precision,
            )
    stages = []
    if layout.pp > 1:
        group = mesh["pp"].get_group()
        stages = [
            TimedStage(view, i, layout.pp * par.virtual_stages, device, group=group)
            for view, i in zip(views, ids, strict=True)
        ]
    strategy = ModelParallel(views[0] if layout.pp == 1 else model, env, stages)
    if optimizer is None:
        return strategy, None
    return strategy, rebuild_optimizer(optimizer, old_names, model)
