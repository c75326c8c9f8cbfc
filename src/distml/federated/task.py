"""What a federation trains: the model (by name from :mod:`distml.models.registry`, so that no
code travels), how a client trains it on its own data, and how a model is evaluated (by
:func:`distml.train.evaluate.evaluate`, in this one process).

A client's update is the *delta* of its parameters, ``local - global``: the quantity the
strategies average, the robust rules compare, differential privacy clips and secure aggregation
masks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from distml.models.registry import model_entry
from distml.train.evaluate import evaluate as evaluate_metrics

# The registry's models a federation trains: classifiers of the digits, whose clients' data are
# (image, label) pairs.
FEDERATED_MODELS: tuple[str, ...] = ("digits-mlp", "digits-cnn")

Params = dict[str, torch.Tensor]


def build_model(name: str, seed: int = 0) -> nn.Module:
    """A fresh model of architecture ``name`` (one of :data:`FEDERATED_MODELS`), initialised
    from ``seed``."""
    if name not in FEDERATED_MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {sorted(FEDERATED_MODELS)}")
    torch.manual_seed(seed)
    return model_entry(name).build()


def get_params(model: nn.Module) -> Params:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def set_params(model: nn.Module, params: Params) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(params[n])


def flatten(params: Params) -> torch.Tensor:
    """The tensors of ``params`` as one vector, in name order."""
    return torch.cat([params[n].reshape(-1) for n in sorted(params)])


def unflatten(vector: torch.Tensor, like: Params) -> Params:
    out, offset = {}, 0
    for n in sorted(like):
        size = like[n].numel()
        out[n] = vector[offset : offset + size].view_as(like[n]).to(like[n].dtype)
        offset += size
    if offset != vector.numel():
        raise ValueError(f"a vector of {vector.numel()} values for {offset} parameters")
    return out


def norm(params: Params) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in params.values()))


@dataclass
class FitResult:
    delta: Params
    num_examples: int
    loss: float  # mean training loss over the local steps


def train_local(
    model: nn.Module,
    data: TensorDataset,
    *,
    epochs: int = 1,
    batch_size: int = 10,
    lr: float = 0.1,
    prox_mu: float = 0.0,
    clip_norm: float | None = None,
    seed: int = 0,
) -> FitResult:
    """``epochs`` passes of SGD over ``data`` in batches of ``batch_size`` (0: the whole data,
    one step per epoch: FedSGD with E = 1), from the model's current (global) parameters.

    With ``prox_mu`` the loss gains FedProx's proximal term mu/2 ||w - w_global||^2 (Li et al.
    2020). With ``clip_norm`` the delta is scaled to that L2 norm at most (client-level DP,
    McMahan et al. 2018)."""
    start = get_params(model)
    n = len(data)
    loader = DataLoader(
        data,
        batch_size=n if batch_size == 0 else batch_size,
        shuffle=batch_size != 0,
        generator=torch.Generator().manual_seed(seed),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model.train()
    losses = []
    for _ in range(epochs):
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            losses.append(float(loss.detach()))
            if prox_mu:
                loss = loss + prox_mu / 2 * sum(
                    (p - start[name]).pow(2).sum() for name, p in model.named_parameters()
                )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    delta = {name: p.detach() - start[name] for name, p in model.named_parameters()}
    if clip_norm is not None:
        scale = min(1.0, clip_norm / max(norm(delta), 1e-12))
        delta = {name: d * scale for name, d in delta.items()}
    return FitResult(delta, n, sum(losses) / max(len(losses), 1))


def evaluate(model: nn.Module, data: TensorDataset, batch_size: int = 512) -> dict[str, float]:
    """Mean cross-entropy and accuracy of ``model`` on the whole of ``data``, in this process."""
    device = next(model.parameters()).device
    metrics = evaluate_metrics(
        model, data, ["loss", "accuracy"], device=device, batch_size=batch_size, shard=(0, 1)
    )
    return {"loss": metrics["loss"], "accuracy": metrics["accuracy"], "num_examples": len(data)}
