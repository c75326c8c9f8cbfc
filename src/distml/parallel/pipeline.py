"""Pipeline parallelism: the model cut into stages at block boundaries, fed with micro-batches.

Stage s of S holds a contiguous run of blocks (the first also the embeddings, the last the final
norm and the head) and passes activations to s+1 and gradients back to s-1, point to point. A
batch is cut into m micro-batches so that the stages work at once; the price is the *bubble*, the
share of a step each stage spends idle while the pipeline fills and drains: (S-1)/(m+S-1) for
GPipe and 1F1B (Huang et al. 2019; Narayanan et al. 2021), (S-1)/(v m+S-1) with v interleaved
stages per rank. 1F1B starts backward as soon as the last stage can, so a stage holds at most S
micro-batches' activations, where GPipe holds all m.

Schedules come from ``torch.distributed.pipelining``. Cutting the model is done here, the way
torchtitan does it: a stage is the same model with the blocks it does not own deleted, so every
parameter keeps its name and checkpoints move between layouts by name. The model must keep its
blocks in a ``ModuleDict`` named ``blocks`` and skip the top-level modules a stage sets to
``None`` (:class:`distml.models.GPT` does). Forward-only work (evaluation, generation) runs the
stages one after the other on the whole batch instead (:func:`forward_through_stages`).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from distml.config import ConfigError, Schedule

SCHEDULES: dict[Schedule, type] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved": ScheduleInterleaved1F1B,
}


def pipeline_bubble(stages: int, microbatches: int, virtual: int = 1) -> float:
    """The idle share of a step: (p-1)/(v m + p-1), p pipeline ranks, v stages per rank."""
    return (stages - 1) / (virtual * microbatches + stages - 1)


def _blocks_of(model: nn.Module) -> nn.ModuleDict:
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleDict):
        raise ConfigError(
            f"pipeline parallelism needs a model that keeps its blocks in a ModuleDict "
            f"'blocks' and skips missing modules (as distml.models.GPT); "
            f"{type(model).__name__} does not"
        )
    return blocks


def _edges(model: nn.Module) -> tuple[list[str], list[str]]:
    """Top-level modules before and after the blocks (the embeddings; the norm and the head)."""
    names = list(model._modules)
    at = names.index("blocks")
    return names[:at], names[at + 1 :]


def cut_stages(
    model: nn.Module, stages: int, split_points: list[str] | None = None
) -> list[list[str]]:
    """The block names of each stage, from ``split_points`` (``"blocks.K"`` starts a stage) or
    balanced by parameter count, the embeddings counted in the first stage and the head in the
    last. Every stage gets at least one block."""
    blocks = _blocks_of(model)
    keys = list(blocks)
    if stages > len(keys):
        raise ConfigError(f"{stages} pipeline stages, but the model has {len(keys)} blocks")
    if split_points is not None:
        starts = []
        for point in split_points:
            key = point.removeprefix("blocks.")
            if key not in keys:
                raise ConfigError(f"split point {point!r} is not a block of the model")
            starts.append(keys.index(key))
        if starts != sorted(set(starts)) or starts[0] == 0:
            raise ConfigError(f"split points {split_points} must name later and later blocks")
        bounds = [0, *starts, len(keys)]
        return [keys[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    before, after = _edges(model)

    def size(m: nn.Module | None) -> int:
        return sum(p.numel() for p in m.parameters()) if m is not None else 0

    weights = [size(blocks[k]) for k in keys]
    weights[0] += sum(size(getattr(model, n)) for n in before)
    weights[-1] += sum(size(getattr(model, n)) for n in after)
    bounds = _balanced_bounds(weights, stages)
    return [keys[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _balanced_bounds(weights: list[int], parts: int) -> list[int]:
    """Cut ``weights`` into ``parts`` contiguous non-empty runs whose heaviest is as light as
    possible (the linear partition problem, by dynamic programming); returns the run bounds."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: the lightest heaviest run cutting the first i weights into k runs.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                heaviest = max(best[k - 1][j], prefix[i] - prefix[j])
                if heaviest < best[k][i]:
                    best[k][i], cut[k][i] = heaviest, j
    bounds = [n]
    for k in range(parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def stage_view(model: nn.Module, keep: list[str], first: bool, last: bool) -> nn.Module:
    """A shallow copy of ``model`` holding only blocks ``keep`` (the module objects themselves,
    shared), with the embeddings only if ``first`` and the head only if ``last``."""
    view = copy.copy(model)
    # Its own module table and hook tables: what FSDP registers on a view stays on that view.
    for key, value in vars(view).items():
        if isinstance(value, (dict, set)):
            view.__dict__[key] = copy.copy(value)
    blocks = _blocks_of(model)
    view._modules["blocks"] = nn.ModuleDict({k: blocks[k] for k in keep})
    before, after = _edges(model)
    for name in before if not first else []:
        view._modules[name] = None
    for name in after if not last else []:
        view._modules[name] = None
    return view


def keep_only(model: nn.Module, stage_blocks: list[list[str]], first: bool, last: bool) -> None:
    """Delete, in place, what none of this rank's stages needs: it never takes memory here."""
    owned = {k for keys in stage_blocks for k in keys}
    blocks = _blocks_of(model)
    for k in [k for k in blocks if k not in owned]:
        del blocks[k]
    before, after = _edges(model)
    for name in before if not first else []:
        setattr(model, name, None)
    for name in after if not last else []:
        setattr(model, name, None)


class TimedStage(PipelineStage):
    """A stage that measures its own busy time, so the bubble is measured, not assumed."""

    busy_s: float = 0.0

    def forward_one_chunk(self, *args, **kwargs):  # noqa: ANN002, ANN003
        start = time.perf_counter()
        try:
            return super().forward_one_chunk(*args, **kwargs)
        finally:
            self.busy_s += time.perf_counter() - start

    def backward_one_chunk(self, *args, **kwargs):  # noqa: ANN002, ANN003
        start = time.perf_counter()
        try:
            return super().backward_one_chunk(*args, **kwargs)
        finally:
            self.busy_s += time.perf_counter() - start


@dataclass
class PipelinePlan:
    """Which stages this pipeline rank runs: stage ids ``rank, rank + pp, ...`` (looped)."""

    pp_rank: int
    pp_size: int
    virtual: int

    @property
    def num_stages(self) -> int:
        return self.pp_size * self.virtual

    @property
    def stage_ids(self) -> list[int]:
        return [self.pp_rank + v * self.pp_size for v in range(self.virtual)]


def build_stages(
    model: nn.Module,
    plan: PipelinePlan,
    split_points: list[str] | None,
) -> tuple[list[nn.Module], list[int]]:
    """Cut ``model`` in place down to this rank's share; returns the stage modules (views of
    it) and their stage ids. Call before tensor parallelism, checkpointing and FSDP, which then
    apply to the blocks the views share."""
    cut = cut_stages(model, plan.num_stages, split_points)
    ids = plan.stage_ids
    first, last = 0 in ids, plan.num_stages - 1 in ids
    keep_only(model, [cut[i] for i in ids], first, last)
    return [stage_view(model, cut[i], i == 0, i == plan.num_stages - 1) for i in ids], ids


def refresh_views(model: nn.Module, views: list[nn.Module]) -> None:
    """Point the views at ``model``'s current blocks, after wrappers replaced some of them."""
    blocks = _blocks_of(model)
    for view in views:
        keys = list(view._modules["blocks"])
        view._modules["blocks"] = nn.ModuleDict({k: blocks[k] for k in keys})


def forward_through_stages(
    x: torch.Tensor,
    stages: list[TimedStage],
    pp_rank: int,
    group: dist.ProcessGroup,
    device: torch.device,
) -> torch.Tensor:
    """The whole model's output for ``x``, on every pipeline rank: the stages run one after
    the other on the whole batch, forward-only work of any batch size, without a schedule's
    fixed micro-batch shapes. ``stages``: this rank's; ``pp_rank``: its place in ``group``."""
    pp = group.size()
    num_stages = stages[0].num_stages
    by_id = {s.stage_index: s.submod for s in stages}
    h = x
    for stage_id in range(num_stages):
        if stage_id % pp == pp_rank:
            if stage_id > 0 and (stage_id - 1) % pp != pp_rank:
                h = _recv_tensor((stage_id - 1) % pp, group, device)
            h = by_id[stage_id](h)
            nxt = (stage_id + 1) % pp
            if stage_id < num_stages - 1 and nxt != pp_rank:
                _send_tensor(h, nxt, group)
    src = (num_stages - 1) % pp
    return _broadcast_tensor(h if pp_rank == src else None, src, group, device)


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
