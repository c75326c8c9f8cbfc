"""Which device a worker computes on, and which process-group backend it joins with.

One CUDA device per worker where GPUs are present (NCCL), the CPU otherwise (gloo). NCCL
refuses two ranks of one group on the same device ("Duplicate GPU detected"), so more workers
on a node than it has GPUs is a configuration error, said before any process starts.
"""

from __future__ import annotations

import torch

from distml.config import ConfigError


def gpu_share_error(processes_per_node: int) -> str | None:
    """Why ``processes_per_node`` ranks of one process group cannot share this node's GPUs,
    or None when they can (or there is no GPU)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0 or processes_per_node <= gpus:
        return None
    return (
        f"{processes_per_node} worker processes on this node but {gpus} CUDA device(s): NCCL "
        f"needs a device of its own for each process. Use --nproc {gpus}, or hide the GPUs "
        "(CUDA_VISIBLE_DEVICES=) to run every worker on the CPU"
    )


def pick_device(local_rank: int, local_world: int, grouped: bool) -> tuple[torch.device, str]:
    """The worker's device and backend. ``grouped``: the node's workers join one process group
    (a parameter server's workers are a world of one each, and may share a GPU)."""
    if torch.cuda.is_available():
        if grouped and (error := gpu_share_error(local_world)):
            raise ConfigError(error)
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device, "cpu:gloo,cuda:nccl"
    return torch.device("cpu"), "gloo"
