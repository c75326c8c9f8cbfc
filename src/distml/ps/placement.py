"""Which parameter-server shard holds which parameter: balanced by bytes.

Largest first onto the lightest shard (Graham's LPT rule: within 4/3 of the best possible
maximum load). Every worker computes the same placement from the model alone, so no one has to
tell anyone.
"""

from __future__ import annotations

import heapq

import torch


def place_parameters(params: dict[str, torch.Tensor], shards: int) -> list[list[str]]:
    """The parameter names each of ``shards`` shards holds, each list in model order."""
    if shards < 1:
        raise ValueError(f"need at least one server shard, got {shards}")
    if shards > len(params):
        raise ValueError(
            f"{shards} server shards for {len(params)} parameters: some would be empty"
        )
    order = {name: i for i, name in enumerate(params)}
    by_size = sorted(
        params, key=lambda n: (-params[n].numel() * params[n].element_size(), order[n])
    )
    heap = [(0, k) for k in range(shards)]
    placed: list[list[str]] = [[] for _ in range(shards)]
    for name in by_size:
        load, k = heapq.heappop(heap)
        placed[k].append(name)
        heapq.heappush(heap, (load + params[name].numel() * params[name].element_size(), k))
    return [sorted(names, key=order.__getitem__) for names in placed]
