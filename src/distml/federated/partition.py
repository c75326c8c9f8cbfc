"""Splitting one labelled dataset over federated clients, the way FL papers simulate non-IID data.

- ``iid``: a random permutation cut in equal parts.
- ``dirichlet:ALPHA``: label skew; each class is divided over the clients in proportions drawn
  from Dirichlet(ALPHA) (Hsu et al. 2019). Small ALPHA: each client sees few classes.
- ``shards:K``: pathological non-IID (McMahan et al. 2017): sort by label, cut into
  clients x K shards of equal size, give each client K of them at random.

Each returns one list of example indices per client; every example goes to exactly one client.
"""

from __future__ import annotations

import numpy as np
import torch

MIN_PER_CLIENT = 2


def parse_partition(spec: str) -> tuple[str, float]:
    """``"iid"``, ``"dirichlet:0.3"`` or ``"shards:2"`` as (kind, parameter)."""
    kind, _, arg = spec.partition(":")
    if kind == "iid" and not arg:
        return kind, 0.0
    try:
        value = float(arg)
    except ValueError:
        value = float("nan")
    if kind == "dirichlet" and value > 0:
        return kind, value
    if kind == "shards" and value >= 1 and value == int(value):
        return kind, value
    raise ValueError(f"partition {spec!r}: expected iid, dirichlet:ALPHA (> 0) or shards:K (>= 1)")


def partition(labels: torch.Tensor, clients: int, spec: str, seed: int = 0) -> list[list[int]]:
    """Indices of ``labels`` for each of ``clients`` clients, split as ``spec`` says."""
    kind, arg = parse_partition(spec)
    n = len(labels)
    if clients < 1 or clients * MIN_PER_CLIENT > n:
        raise ValueError(
            f"{n} examples cannot give {clients} clients {MIN_PER_CLIENT} examples each"
        )
    gen = torch.Generator().manual_seed(seed)
    if kind == "iid":
        order = torch.randperm(n, generator=gen)
        return [part.tolist() for part in order.tensor_split(clients)]
    if kind == "shards":
        return _shards(labels, clients, int(arg), gen)
    return _dirichlet(labels, clients, arg, seed)


def _shards(labels: torch.Tensor, clients: int, k: int, gen: torch.Generator) -> list[list[int]]:
    if clients * k > len(labels):
        raise ValueError(f"{len(labels)} examples cannot make {clients} x {k} shards")
    # Sort by label, ties in random order, so that each shard holds one or two classes.
    shuffled = torch.randperm(len(labels), generator=gen)
    by_label = shuffled[torch.argsort(labels[shuffled], stable=True)]
    shards = by_label.tensor_split(clients * k)
    assignment = torch.randperm(clients * k, generator=gen).view(clients, k)
    return [torch.cat([shards[s] for s in row]).tolist() for row in assignment.tolist()]


def _dirichlet(labels: torch.Tensor, clients: int, alpha: float, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    y = labels.numpy()
    # Redraw until every client has a few examples (with small alpha and many clients a draw
    # can leave one empty); the draws come from one seeded generator, so the result is fixed.
    for _ in range(1000):
        parts: list[list[int]] = [[] for _ in range(clients)]
        for c in np.unique(y):
            idx = rng.permutation(np.flatnonzero(y == c))
            cuts = (np.cumsum(rng.dirichlet(np.full(clients, alpha))) * len(idx)).round()
            for client, chunk in enumerate(np.split(idx, cuts.astype(int)[:-1])):
                parts[client].extend(chunk.tolist())
        if min(len(p) for p in parts) >= MIN_PER_CLIENT:
            return parts
    raise ValueError(
        f"dirichlet:{alpha} left a client with fewer than {MIN_PER_CLIENT} examples in 1000 "
        f"draws; use fewer clients or a larger alpha"
    )
