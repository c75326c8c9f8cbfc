"""Profiling the planned model's pieces on this machine, so that the cost model adds measured
times instead of FLOPs at a matmul rate.

A step of a small model on a CPU, or of any model on a GPU, is far from peak FLOP/s: attention,
norms, the optimizer, dispatch and, under tensor parallelism, DTensor's bookkeeping. Like the
profiling planners (Galvatron, Miao et al. 2022; Alpa's stage profiling, Zheng et al. 2022),
:func:`profile_gpt` times, in every worker of the world at once (so that workers that share a
machine share it as they would in training):

- one transformer block's forward, and forward + backward, for each (micro-batch, tensor
  degree) a layout of this world would run, the tensor-parallel ones split by distml's own
  Megatron plan over groups of that many ranks, their all-reduces included;
- under a data-parallel layout with FSDP (ZeRO-2 and -3, and ZeRO-0 with model parallelism),
  a stage's blocks as FSDP units: with their collectives, FSDP's copies and AdamW's step over
  DTensor shards, which the collectives alone do not account for;
- the embeddings' and the head's (with its loss) forward + backward per micro-batch;
- AdamW's step, per parameter;
- all-reduce, all-gather, reduce-scatter over groups of every size, and point-to-point, fitted
  to the latency-bandwidth model ``t = alpha + n / beta`` of n bytes (Hockney 1994);
- ``share``: how much slower a block runs while every worker computes than alone. Workers that
  share cores (more processes than cores) fill each other's pipeline bubbles, and their
  collectives take those cores too, so nothing of them overlaps.

The result is a table of a cluster file (``[calibration]``) for one model;
:func:`distml.plan.cost_model.predict` uses it for that model and falls back to the formulas for
any other.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from distml.config import GPTConfig
from distml.models.gpt import GPT, Block, lm_loss
from distml.plan.timing import median_time

# scipy and torch's DTensor, FSDP and device-mesh modules are imported by the functions that
# profile those layouts: a plain profile, and `distml plan`, never pay for them.

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
SIZES = (2**16, 2**18, 2**20, 2**22, 2**24)  # bytes per rank's input


def shape_key(micro_batch: int, tp: int) -> str:
    return f"{micro_batch}x{tp}"


def _median_s(fn: Callable[[], Any], repeats: int) -> float:
    """Seconds of ``fn()`` after one warm-up, each run started at a barrier of the world so that
    every worker runs it at the same time: the median over runs of the slowest worker's time,
    as the slowest sets the pace of a synchronous step."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    fn()
    times = torch.zeros(repeats, dtype=torch.float64)
    for i in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        sync()
        times[i] = time.perf_counter() - start
    dist.barrier()
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times.median().item()


def _fit(sizes: list[float], seconds: list[float]) -> tuple[float, float]:
    """``t = alpha + n / beta`` fitted to relative error (a small message's latency counts as
    much as a large one's bandwidth), alpha and 1 / beta >= 0: non-negative least squares of
    alpha / t + (1 / beta) n / t = 1 over the measurements."""
    from scipy.optimize import nnls

    t = np.asarray(seconds)
    rows = np.stack([1 / t, np.asarray(sizes) / t], axis=1)
    (alpha, slope), _ = nnls(rows, np.ones_like(t))
    return float(alpha), 1.0 / max(float(slope), 1e-15)


def subgroups() -> dict[int, dist.ProcessGroup]:
    """``{size: this rank's group of size consecutive ranks}`` for every size > 1 that divides
    the world (every rank creates every group)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = {}
    for size in (d for d in range(2, world + 1) if world % d == 0):
        for start in range(0, world, size):
            group = dist.new_group(list(range(start, start + size)))
            if start <= rank < start + size:
                mine[size] = group
    return mine


# torch 2.13 renamed the single-tensor collectives and deprecated the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _collective(name: str, nbytes: int, group: dist.ProcessGroup) -> Callable[[], Any]:
    """One call of ``name`` with ``nbytes`` of input on each rank of ``group``."""
    size = dist.get_world_size(group)
    x = torch.ones(nbytes // 4)
    if name == "all_reduce":
        return lambda: dist.all_reduce(x, group=group)
    if name == "all_gather":
        gathered = torch.empty(x.numel() * size)
        return lambda: _all_gather(gathered, x, group=group)
    shard = torch.empty(x.numel() // size)
    return lambda: _reduce_scatter(shard, x, group=group)


def _send_pair(nbytes: int) -> Callable[[], None]:
    """Rank 2i sends ``nbytes`` to rank 2i + 1."""
    x, rank = torch.ones(nbytes // 4), dist.get_rank()

    def pair() -> None:
        if rank % 2 == 0:
            dist.send(x, rank + 1)
        else:
            dist.recv(x, rank - 1)

    return pair


def collective_costs(
    groups: dict[int, dist.ProcessGroup], repeats: int = 5
) -> dict[str, dict[str, list[float]]]:
    """``{collective: {group size: [alpha_s, beta_bytes_per_s]}}`` with n the bytes of each
    rank's input (all-gather: its shard; reduce-scatter: the whole tensor), over ``groups``
    (:func:`subgroups`), every group of the world running at once; ``"p2p"`` for one send
    between a pair of ranks."""
    sizes = [float(n) for n in SIZES]
    out: dict[str, dict[str, list[float]]] = {c: {} for c in COLLECTIVES}
    for size, group in groups.items():
        for name in COLLECTIVES:
            seconds = [_median_s(_collective(name, n, group), repeats) for n in SIZES]
            out[name][str(size)] = list(_fit(sizes, seconds))
    seconds = [_median_s(_send_pair(n), repeats) for n in SIZES]
    out["p2p"] = {"2": list(_fit(sizes, seconds))}
    return out


def _block(cfg: GPTConfig, tp_mesh: Any = None) -> Block:
    """A block, split by distml's Megatron plan over ``tp_mesh`` when there is one."""
    block = Block(cfg)
    if tp_mesh is not None:
        from torch.distributed.tensor.parallel import parallelize_module

        from distml.parallel.tensor import gpt_block_plan

        parallelize_module(block, tp_mesh, gpt_block_plan(False))
    return block


def _hidden(cfg: GPTConfig, micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's input (it needs a gradient, as inside a model) and a gradient of its output."""
    x = torch.randn(micro_batch, cfg.seq_len, cfg.hidden, requires_grad=True)
    return x, torch.randn_like(x)


def _block_times(
    cfg: GPTConfig, micro_batch: int, tp: int, repeats: int, groups: dict[int, Any]
) -> dict[str, float]:
    """One block's forward and forward + backward at ``micro_batch``, split over ``tp`` ranks."""
    torch.manual_seed(0)
    block = _block(cfg, groups[tp] if tp > 1 else None)
    x, grad = _hidden(cfg, micro_batch)

    def forward() -> None:
        with torch.no_grad():
            block(x)

    def forward_backward() -> None:
        block(x).backward(grad)

    return {
        "fwd_s": _median_s(forward, repeats),
        "fwdbwd_s": _median_s(forward_backward, repeats),
    }


def _sharded_stage(
    cfg: GPTConfig, micro_batch: int, tp: int, zero: int, k: int, repeats: int, mesh: Any
) -> dict[str, float]:
    """A pipeline stage's ``k`` blocks (the whole model's, without a pipeline), each an FSDP
    unit, under a root unit of no parameters of its own, as distml shards a model (ZeRO-0:
    replicated over ``dp``, HSDP with shards of one): forward + backward synchronising the
    gradients, the same without (a pipeline's micro-batches but the last), and AdamW's step
    over the shards. FSDP's collectives, its copies and DTensor's dispatch are in them."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    blocks = [_block(cfg, mesh["tp"] if tp > 1 else None) for _ in range(k)]
    data = mesh["dp", "fsdp"] if zero == 0 else mesh["dp"]
    for block in blocks:
        fully_shard(block, mesh=data, reshard_after_forward=zero != 2)
    root = fully_shard(nn.Sequential(*blocks), mesh=data, reshard_after_forward=zero != 2)
    opt = torch.optim.AdamW(root.parameters(), lr=1e-3)
    x, grad = _hidden(cfg, micro_batch)

    def step() -> None:
        root(x).backward(grad)

    root.set_requires_gradient_sync(False)
    root.set_reshard_after_backward(False)
    nosync = _median_s(step, repeats)
    root.set_requires_gradient_sync(True)
    root.set_reshard_after_backward(True)
    synced = _median_s(step, repeats)
    return {"sync_s": synced, "nosync_s": nosync, "opt_s": _median_s(opt.step, repeats)}


def _edge_times(cfg: GPTConfig, micro_batch: int, repeats: int) -> dict[str, float]:
    """The embeddings' and the head's (final norm, output layer, loss) forward + backward."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**cfg.model_dump(), "layers": 1}))
    ids = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len))
    positions = torch.arange(cfg.seq_len)
    hidden = torch.randn(micro_batch, cfg.seq_len, cfg.hidden, requires_grad=True)

    def embed() -> None:
        (model.embed(ids) + model.pos(positions)).sum().backward()

    def head() -> None:
        lm_loss(model.head(model.norm(hidden)), ids).backward()

    return {"embed_s": _median_s(embed, repeats), "head_s": _median_s(head, repeats)}


def _optimizer_s_per_param(repeats: int, n: int = 2**20) -> float:
    """AdamW's step over ``n`` fp32 parameters in 8 tensors, per parameter."""
    params = [torch.nn.Parameter(torch.randn(n // 8)) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3)
    return _median_s(opt.step, repeats) / n


def reference_block_s(cfg: GPTConfig, micro_batch: int, repeats: int = 9) -> float:
    """One plain block's forward + backward at ``micro_batch``, every worker of the world at
    once: the profile's ``blocks[f"{micro_batch}x1"]["fwdbwd_s"]`` timed again, to tell how fast
    the machine runs now against when it was profiled."""
    return _block_times(cfg, micro_batch, 1, repeats, {})["fwdbwd_s"]


def _share(cfg: GPTConfig, micro_batch: int, repeats: int) -> float:
    """A block's forward + backward with every worker computing, over rank 0's alone."""
    # Timed here, just before the block alone, not taken from the profile: the machine's speed
    # drifts, and a ratio of two times apart would carry the drift.
    together = reference_block_s(cfg, micro_batch, repeats)
    block = _block(cfg)
    x, grad = _hidden(cfg, micro_batch)
    alone = torch.zeros(1, dtype=torch.float64)
    dist.barrier()
    if dist.get_rank() == 0:
        alone[0] = median_time(lambda: block(x).backward(grad), repeats)
    dist.broadcast(alone, 0)
    return max(1.0, together / alone.item())


def median_of(passes: list[Any]) -> Any:
    """The passes' common structure (dicts and lists of numbers), each number the median of
    its values over the passes."""
    first = passes[0]
    if isinstance(first, dict):
        return {k: median_of([p[k] for p in passes]) for k in first}
    if isinstance(first, list):
        return [median_of([p[i] for p in passes]) for i in range(len(first))]
    return float(np.median(passes))


def sharded_key(micro_batch: int, tp: int, dp: int, zero: int, blocks: int) -> str:
    return f"{micro_batch}x{tp}x{dp}x{zero}x{blocks}"


def profile_gpt(
    cfg: GPTConfig,
    shapes: Iterable[tuple[int, int]],
    sharded: Iterable[tuple[int, int, int, int, int]] = (),
    device: torch.device | None = None,
    repeats: int = 9,
    passes: int = 1,
) -> dict[str, Any]:
    """Run in every worker of the world, fp32; the same result on every rank. ``shapes``: the
    (micro-batch, tensor degree) pairs to profile blocks at; ``sharded``: the (micro-batch,
    tensor degree, data degree, ZeRO stage, blocks a stage) of FSDP stages to profile.

    With ``passes`` > 1 every piece is measured once a pass, the passes one after another, and
    each number is the median over them: a piece timed during a burst of other work on a
    shared machine (a piece takes well under a second) counts once, not for good."""
    from torch.distributed.device_mesh import init_device_mesh

    device = device or torch.device("cpu")
    world = dist.get_world_size()
    shapes, sharded = sorted(set(shapes)), sorted(set(sharded))
    micro_batches = sorted({b for b, _ in shapes})
    groups = {}
    for t in sorted({t for _, t in shapes if t > 1}):
        mesh = init_device_mesh(device.type, (world // t, t), mesh_dim_names=("rest", "tp"))
        groups[t] = mesh["tp"]
    meshes = {}
    for _, t, d, _, _ in sharded:
        meshes[t, d] = init_device_mesh(
            device.type, (world // (d * t), d, 1, t), mesh_dim_names=("rest", "dp", "fsdp", "tp")
        )
    collective_groups = subgroups()  # made once: each pass times the same groups

    def one_pass() -> dict[str, Any]:
        blocks = {shape_key(b, t): _block_times(cfg, b, t, repeats, groups) for b, t in shapes}
        stages = {
            sharded_key(b, t, d, z, k): _sharded_stage(cfg, b, t, z, k, repeats, meshes[t, d])
            for b, t, d, z, k in sharded
        }
        return {
            "blocks": blocks,
            "sharded_stages": stages,
            "edges": {str(b): _edge_times(cfg, b, repeats) for b in micro_batches},
            "share": _share(cfg, micro_batches[0], repeats),
            "optimizer_s_per_param": _optimizer_s_per_param(repeats),
            "collectives": collective_costs(collective_groups, repeats),
        }

    with device:
        measured = median_of([one_pass() for _ in range(passes)])
    return {
        "model": {
            "layers": cfg.layers,
            "hidden": cfg.hidden,
            "heads": cfg.heads,
            "seq": cfg.seq_len,
            "vocab": cfg.vocab_size,
        },
        "precision": "fp32",
        "world": world,
        **measured,
    }
