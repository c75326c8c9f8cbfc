"""A layout on the mesh pp x dp x fsdp x tp, applied to a plain model in one visible order.

``apply_layout`` does what torchtitan's ``parallelize_llama`` does: cut the pipeline stages first,
then on what this rank keeps apply tensor parallelism, then activation checkpointing, then FSDP
(HSDP when ``dp`` > 1 too). The result, :class:`ModelParallel`, is the strategy object
:class:`distml.runtime.context.Context` drives: one step's forward and backward (through a
pipeline schedule when ``pp`` > 1), and a forward for evaluation and generation.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from distml.config import ConfigError, RunConfig
from distml.parallel.activation_checkpoint import checkpoint_blocks
from distml.parallel.mesh import ParallelDims
from distml.parallel.pipeline import (
    SCHEDULES,
    PipelinePlan,
    TimedStage,
    build_stages,
    refresh_views,
)
from distml.parallel.sharded import apply_fsdp
from distml.parallel.tensor import apply_tensor_parallel, resolve_tp_plan

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
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


class ModelParallel:
    """A model laid out on the mesh, with the step and the forward that the layout needs."""

    def __init__(
        self,
        model: nn.Module,
        dims: ParallelDims,
        mesh: DeviceMesh,
        config: RunConfig,
        device: torch.device,
        stages: list[TimedStage],
    ):
        self.model = model  # what this rank holds, under the plain model's parameter names
        self.dims = dims
        self.mesh = mesh
        self.config = config
        self.device = device
        self.stages = stages
        self._schedule: Any = None
        self._schedule_loss: Loss | None = None
        self.span_s = 0.0
        self.pp_group = mesh["pp"].get_group() if dims.pp > 1 else None
        self.fsdp = dims.data_parallel > 1 or dims.fsdp > 1

    # -- groups -----------------------------------------------------------------------------
    @property
    def data_group(self) -> dist.ProcessGroup | None:
        """The ranks that see different batches (dp x fsdp); None if there is only one."""
        if self.dims.data_parallel == 1:
            return None
        return self.mesh["dp", "fsdp"]._flatten("data").get_group()

    # -- training ---------------------------------------------------------------------------
    def forward_backward(
        self,
        batch: Any,
        loss: Loss | None,
        compute_loss: Callable[[Any], torch.Tensor] | None,
        autocast: Callable[[], AbstractContextManager],
        split: Callable[[Any, int], list[Any]],
    ) -> float:
        """Forward and backward of one step's batch; returns its mean loss on every rank."""
        if self.dims.pp > 1:
            if loss is None:
                raise ValueError(
                    "pipeline parallelism needs ctx.train_step((inputs, targets), loss=fn): "
                    "the last stage computes fn(output, targets)"
                )
            return self._pipeline_step(batch, loss, autocast)
        accum = self.config.strategy.grad_accum
        total = len(batch[0] if isinstance(batch, (tuple, list)) else batch)
        parts = split(batch, min(accum, total)) if accum > 1 else [batch]
        value = torch.zeros((), device=self.device)
        for i, micro in enumerate(parts):
            if self.fsdp:  # reduce gradients once, with the last micro-batch
                self.model.set_requires_gradient_sync(i == len(parts) - 1)
            with autocast():
                if loss is not None:
                    out = loss(self.model(micro[0]), micro[1])
                else:
                    out = compute_loss(micro)
            weight = len(micro[0] if isinstance(micro, (tuple, list)) else micro) / total
            (out * weight).backward()
            value += out.detach() * weight
        return value.item()

    def _pipeline_step(self, batch: Any, loss: Loss, autocast) -> float:  # noqa: ANN001
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
        with autocast():
            args = (x,) if first else ()
            kwargs = {"target": y, "losses": losses} if last else {}
            schedule.step(*args, **kwargs)
        self.span_s = time.perf_counter() - start
        value = torch.stack(losses).mean().detach() if last else torch.zeros((), device=x.device)
        src = dist.get_global_rank(self.pp_group, self.dims.pp - 1)
        dist.broadcast(value, src=src, group=self.pp_group)
        return value.item()

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
        if self.dims.pp == 1:
            return self.model(x)
        pp_rank = self.mesh["pp"].get_local_rank()
        num_stages = self.stages[0].num_stages
        by_id = {s.stage_index: s.submod for s in self.stages}
        h = x
        for stage_id in range(num_stages):
            owner = stage_id % self.dims.pp
            if owner == pp_rank:
                if stage_id > 0 and (stage_id - 1) % self.dims.pp != pp_rank:
                    h = _recv_tensor((stage_id - 1) % self.dims.pp, self.pp_group, self.device)
                h = by_id[stage_id](h)
                nxt = (stage_id + 1) % self.dims.pp
                if stage_id < num_stages - 1 and nxt != pp_rank:
                    _send_tensor(h, nxt, self.pp_group)
        src = (num_stages - 1) % self.dims.pp
        return _broadcast_tensor(h if pp_rank == src else None, src, self.pp_group, self.device)


def _header(t: torch.Tensor) -> torch.Tensor:
    return torch.tensor([_DTYPES.index(t.dtype), t.dim(), *t.shape], dtype=torch.long)


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]


def _send_tensor(t: torch.Tensor, dst: int, group: dist.ProcessGroup) -> None:
    header = _header(t)
    dist.send(torch.tensor([len(header)]), group_dst=dst, group=group)
    dist.send(header, group_dst=dst, group=group)
    dist.send(t.contiguous(), group_dst=dst, group=group)


def _recv_tensor(src: int, group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    size = torch.zeros(1, dtype=torch.long)
    dist.recv(size, group_src=src, group=group)
    header = torch.zeros(int(size), dtype=torch.long)
    dist.recv(header, group_src=src, group=group)
    dtype, ndim = _DTYPES[int(header[0])], int(header[1])
    t = torch.empty(header[2 : 2 + ndim].tolist(), dtype=dtype, device=device)
    dist.recv(t, group_src=src, group=group)
    return t


def _broadcast_tensor(
    t: torch.Tensor | None, src: int, group: dist.ProcessGroup, device: torch.device
) -> torch.Tensor:
    header = _header(t) if t is not None else torch.zeros(8, dtype=torch.long)
    size = torch.tensor([len(header)])
    src_rank = dist.get_global_rank(group, src)
    dist.broadcast(size, src=src_rank, group=group)
    if t is None:
        header = torch.zeros(int(size), dtype=torch.long)
    dist.broadcast(header, src=src_rank, group=group)
    if t is None:
        ndim = int(header[1])
        t = torch.empty(header[2 : 2 + ndim].tolist(), dtype=_DTYPES[int(header[0])], device=device)
    dist.broadcast(t, src=src_rank, group=group)
    return t


def apply_layout(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    dims: ParallelDims,
    mesh: DeviceMesh,
    config: RunConfig,
    device: torch.device,
) -> tuple[ModelParallel, torch.optim.Optimizer | None]:
    """Pipeline stages, then tensor parallelism, then activation checkpointing, then FSDP."""
    par = config.parallel
    old_names = {id(p): name for name, p in model.named_parameters()}
    tp_plan = resolve_tp_plan(model, par.tp_plan) if par.tp_plan is not None else None
    views: list[nn.Module] = [model]
    ids = [0]
    if dims.pp > 1:
        plan = PipelinePlan(mesh["pp"].get_local_rank(), dims.pp, par.virtual_stages)
        views, ids = build_stages(model, plan, par.split_points)
    if dims.tp > 1:
        apply_tensor_parallel(model, mesh["tp"], tp_plan, par.sequence_parallel)
    blocks = getattr(model, "blocks", None)
    if par.activation_checkpointing != "none":
        if not isinstance(blocks, nn.ModuleDict):
            raise ConfigError("activation checkpointing needs the blocks in a ModuleDict 'blocks'")
        checkpoint_blocks(blocks, par.activation_checkpointing)
        if dims.pp > 1:
            refresh_views(model, views)
    if dims.data_parallel > 1 or dims.fsdp > 1:
        units = list(blocks.values()) if isinstance(blocks, nn.ModuleDict) else []
        # HSDP (2-D: replicate x shard) only when there are replicas to all-reduce across.
        data_mesh = mesh["dp", "fsdp"] if dims.dp > 1 else mesh["fsdp"]
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
    if dims.pp > 1:
        group = mesh["pp"].get_group()
        stages = [
            TimedStage(view, i, dims.pp * par.virtual_stages, device, group=group)
            for view, i in zip(views, ids, strict=True)
        ]
    strategy = ModelParallel(
        views[0] if dims.pp == 1 else model, dims, mesh, config, device, stages
    )
    if optimizer is None:
        return strategy, None
    return strategy, rebuild_optimizer(optimizer, old_names, model)
