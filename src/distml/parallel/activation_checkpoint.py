"""Activation checkpointing per block: keep less for backward, recompute it instead.

``full`` keeps only each block's input and recomputes the whole block in backward (Chen et al.
2016). ``selective`` recomputes only the attention core -- scores, mask, softmax, the weighted
sum -- whose activations grow with the square of the sequence while costing few FLOPs, and keeps
the matrix multiplications' (Korthikanti et al. 2022). Either wraps modules in torch's
``checkpoint_wrapper`` (non-reentrant); parameter names do not change.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from distml.config import ConfigError


class _Hold(torch.autograd.Function):
    """Identity that saves its inputs for backward. A checkpointed module keeps its inputs
    alive through its recompute closure, where saved-tensor hooks (and so the activation
    accounting of :mod:`distml.telemetry.memory`) cannot see them; saving them here shows them,
    at no cost in memory (the same storage) and none in time (no copy)."""

    @staticmethod
    def forward(ctx, *xs: torch.Tensor):  # noqa: ANN001
        ctx.save_for_backward(*xs)
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # noqa: ANN001
        return grads


def _hold_inputs(module: nn.Module, args: tuple) -> tuple:
    if not torch.is_grad_enabled() or not all(isinstance(a, torch.Tensor) for a in args):
        return args
    return _Hold.apply(*args)


def _checkpoint(module: nn.Module) -> nn.Module:
    wrapped = checkpoint_wrapper(module, preserve_rng_state=False)
    wrapped.register_forward_pre_hook(_hold_inputs)
    return wrapped


def checkpoint_blocks(blocks: nn.ModuleDict, mode: str) -> None:
    """Wrap, in place, every block (``full``) or every block's ``attn.core`` (``selective``)."""
    if mode == "none":
        return
    for name, block in blocks.items():
        if mode == "full":
            blocks[name] = _checkpoint(block)
            continue
        attn = getattr(block, "attn", None)
        if attn is None or not hasattr(attn, "core"):
            raise ConfigError(
                "selective activation checkpointing recomputes a block's attn.core "
                f"(as in distml.models.GPT); block {name} has none: use full"
            )
        attn.core = _checkpoint(attn.core)
