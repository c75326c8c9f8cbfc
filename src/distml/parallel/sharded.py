"""Sharded data parallelism: FSDP2 ``fully_shard``, ZeRO-3 semantics (Rajbhandari et al. 2020).

Each block is its own FSDP unit: its parameters, gradients and optimizer state live 1/N on each of
the N ``fsdp`` ranks; forward all-gathers a block's parameters just before it runs and frees them
after, backward gathers them again and reduce-scatters the gradients. With
``reshard_after_forward=False`` the gathered parameters stay from forward to backward (one
all-gather a step instead of two, ZeRO-2-like). With a ``dp`` dimension too, the mesh is 2-D and
FSDP2 runs HSDP: sharded within ``fsdp``, replicated (gradients all-reduced) across ``dp``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def apply_fsdp(
    root: nn.Module,
    units: list[nn.Module],
    mesh: DeviceMesh,
    *,
    reshard_after_forward: bool = True,
    mixed_precision: str = "fp32",
) -> None:
    """Shard each of ``units`` (the blocks), then ``root`` for what is left (embeddings, head).

    bf16 mixed precision computes with bf16 copies of the parameters and reduces gradients in
    fp32, as torchtitan does.
    """
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision == "bf16"
        else MixedPrecisionPolicy()
    )
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    fully_shard(root, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
