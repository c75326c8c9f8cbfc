"""Tensor parallelism: one layer split across ranks, Megatron-style (Shoeybi et al. 2019).

Attention's q, k and v projections are split by columns (each rank computes whole heads) and
its output projection by rows; likewise the MLP's up and down projections. A block then needs two
all-reduces of its (batch, sequence, hidden) activations in forward (after attention, after the
MLP) and two in backward (of the gradients entering attention and the MLP): 4 b s h per block per
micro-batch. q, k and v share one input annotated once (``PrepareModuleInput``), so their
backward is one all-reduce, not three.

With sequence parallelism (Korthikanti et al. 2022) the norms and the residual stream are split
along the sequence instead of repeated: each all-reduce becomes an all-gather before the layer and
a reduce-scatter after it (the same bytes), and the norms' activations shrink by tp.

Built on DTensor's ``parallelize_module``; applied from outside the model.
"""

from __future__ import annotations

import fnmatch

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from distml.config import ConfigError
from distml.models.gpt import GPT


def gpt_block_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The Megatron plan of one :class:`distml.models.gpt.Block`."""
    if not sequence_parallel:
        return {
            "attn": PrepareModuleInput(
                input_layouts=(Replicate(),),
                desired_input_layouts=(Replicate(),),
                use_local_output=False,
            ),
            "attn.q": ColwiseParallel(),
            "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(),
            "attn.out": RowwiseParallel(),
            "mlp.up": ColwiseParallel(),
            "mlp.down": RowwiseParallel(),
        }
    gather = PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=False
    )
    return {
        "attn_norm": SequenceParallel(),
        "attn": gather,
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.out": RowwiseParallel(output_layouts=Shard(1)),
        "mlp_norm": SequenceParallel(),
        "mlp": gather,
        "mlp.up": ColwiseParallel(),
        "mlp.down": RowwiseParallel(output_layouts=Shard(1)),
    }


def apply_gpt_tensor_parallel(model: GPT, mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Split every block of ``model`` (or of the pipeline stage it became) over ``mesh``."""
    plan = gpt_block_plan(sequence_parallel)
    for block in model.blocks.values():
        parallelize_module(block, mesh, plan)
    if not sequence_parallel:
        return
    # The residual stream is split along the sequence from the first block to the final norm.
    blocks = list(model.blocks.values())
    if model.embed is not None and blocks:
        parallelize_module(
            blocks[0],
            mesh,
            PrepareModuleInput(
                input_layouts=(Replicate(),),
                desired_input_layouts=(Shard(1),),
                use_local_output=True,
            ),
        )
    if model.norm is not None:
        parallelize_module(model.norm, mesh, SequenceParallel())
        parallelize_module(
            model.head,
            mesh,
            PrepareModuleInput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
                use_local_output=True,
            ),
        )


_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def resolve_tp_plan(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """Expand a user's ``{module-name pattern: colwise | rowwise}`` against the whole model,
    before it is split, so that a pattern naming nothing is an error and not a silent no-op."""
    names = [name for name, _ in model.named_modules() if name]
    resolved: dict[str, str] = {}
    for pattern, style in plan.items():
        matches = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not matches:
            raise ConfigError(f"tp_plan: {pattern!r} names no module of {type(model).__name__}")
        for name in matches:
            if not isinstance(model.get_submodule(name), nn.Linear):
                raise ConfigError(f"tp_plan: {name} is not an nn.Linear")
            resolved[name] = style
    return resolved


def apply_tensor_parallel(
    model: nn.Module,
    mesh: DeviceMesh,
    plan: dict[str, str] | None,
    sequence_parallel: bool = False,
) -> None:
    """The GPT's Megatron plan, or a resolved user plan (:func:`resolve_tp_plan`) applied to the
    modules of it that ``model`` (perhaps one pipeline stage) still holds."""
    if plan is None:
        if not isinstance(model, GPT):
            raise ConfigError(
                f"tensor parallelism of a {type(model).__name__} needs parallel.tp_plan "
                '(module name -> "colwise" or "rowwise")'
            )
        apply_gpt_tensor_parallel(model, mesh, sequence_parallel)
        return
    if sequence_parallel:
        raise ConfigError("sequence parallelism is built in for the GPT only, not for a tp_plan")
    present = {name for name, _ in model.named_modules()}
    styles = {name: _STYLES[style]() for name, style in plan.items() if name in present}
    parallelize_module(model, mesh, styles)
