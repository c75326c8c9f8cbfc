"""Distributed validation whose result equals single-process evaluation exactly.

Each rank evaluates its own contiguous block of the dataset (:func:`distml.data.eval_shard`:
nothing padded, nothing dropped), sums per-sample metric values in float64, and one all-reduce of
the sums and the sample count gives every rank the exact dataset-wide means.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from distml.data.sampler import eval_shard

Metric = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """1.0 for each sample whose arg-max class is the target, else 0.0."""
    return (output.argmax(dim=-1) == target).to(torch.float64)


def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-sample cross-entropy loss."""
    return F.cross_entropy(output.float(), target, reduction="none")


def token_accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Language modelling: each sequence's share of positions whose next token is predicted."""
    return (output.argmax(dim=-1) == target).to(torch.float64).mean(dim=-1)


def token_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Language modelling: each sequence's mean next-token cross-entropy."""
    per_token = F.cross_entropy(output.float().transpose(1, 2), target, reduction="none")
    return per_token.mean(dim=-1)


METRICS: dict[str, Metric] = {"accuracy": accuracy, "loss": cross_entropy}
LM_METRICS: dict[str, Metric] = {"accuracy": token_accuracy, "loss": token_loss}


def resolve_metrics(metrics: Mapping[str, Metric] | list[str] | None) -> dict[str, Metric]:
    if metrics is None:
        return dict(METRICS)
    if isinstance(metrics, Mapping):
        return dict(metrics)
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise ValueError(f"unknown metric(s) {unknown}; built in: {sorted(METRICS)}")
    return {m: METRICS[m] for m in metrics}


@torch.no_grad()
def evaluate(
    model: nn.Module,
    dataset: Dataset,
    metrics: Mapping[str, Metric] | list[str] | None = None,
    *,
    device: torch.device,
    batch_size: int = 256,
    group: dist.ProcessGroup | None = None,
    forward: Callable[[torch.Tensor], torch.Tensor] | None = None,
    shard: tuple[int, int] | None = None,
) -> dict[str, float]:
    """Means of per-sample ``metrics`` over the whole ``dataset``, on every rank.

    A metric maps (model output, target) of a batch to one value per sample. ``forward``
    replaces ``model(x)`` (a layout's forward through its pipeline); ``shard`` = (index, count)
    says which block of the dataset this rank reads when ``group`` is not the whole world but
    other ranks read the same block (tensor- and pipeline-parallel peers); sums are reduced over
    ``group`` (None: the whole world) when there is more than one block.
    """
    fns = resolve_metrics(metrics)
    forward = forward or model
    rank, world = shard if shard is not None else (dist.get_rank(group), dist.get_world_size(group))
    shard = Subset(dataset, eval_shard(dataset, rank, world))
    totals = torch.zeros(len(fns) + 1, dtype=torch.float64, device=device)
    was_training = model.training
    model.eval()
    try:
        for x, y in DataLoader(shard, batch_size=batch_size):
            x, y = x.to(device), y.to(device)
            out = forward(x)
            for i, fn in enumerate(fns.values()):
                totals[i] += fn(out, y).to(torch.float64).sum()
            totals[-1] += len(y)
    finally:
        model.train(was_training)
    if world > 1:
        dist.all_reduce(totals, group=group)
    count = totals[-1].item()
    result = {name: totals[i].item() / count for i, name in enumerate(fns)}
    result["samples"] = int(count)
    return result
