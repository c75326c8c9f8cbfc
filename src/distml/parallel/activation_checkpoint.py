"""Activation checkpointing per block: keep less for backward, recompute it instead.

``full`` keeps only each block's input and recomputes the block in backward (Chen et al. 2016);
``selective`` keeps the outputs of the matrix multiplications and recomputes the cheap,
memory-hungry rest -- attention scores, softmax, GELU, norms -- as Korthikanti et al. 2022
propose, through torch's selective-checkpoint policies.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_SAVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.linear.default,
}


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:  # noqa: ANN001
    return CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_blocks(blocks: nn.ModuleDict, mode: str) -> None:
    """Wrap every block of ``blocks`` in place; its parameters keep their names."""
    if mode == "none":
        return
    context_fn = (
        partial(create_selective_checkpoint_contexts, _policy) if mode == "selective" else None
    )
    for name, block in blocks.items():
        kwargs = {"context_fn": context_fn} if context_fn is not None else {}
        blocks[name] = checkpoint_wrapper(block, preserve_rng_state=False, **kwargs)
