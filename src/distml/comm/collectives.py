"""Collectives whose bytes and timing are accounted, and JSON exchange between ranks.

Byte counts are *payload* bytes: the size of the tensor a rank contributes to a collective.
``wire`` bytes are what a bandwidth-optimal ring moves out of each rank for it (Patarasuk and Yuan
2009): all-reduce 2(N-1)/N x payload, all-gather and reduce-scatter (N-1)/N x the full tensor,
broadcast 1 x payload.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist


def ring_wire_bytes(collective: str, payload: int, world_size: int) -> int:
    n = world_size
    if n <= 1:
        return 0
    factor = {
        "all_reduce": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "broadcast": 1.0,
    }[collective]
    return round(payload * factor)


def all_gather_json(obj: Any, device: torch.device, group: dist.ProcessGroup | None = None) -> list:
    """Every rank's ``obj`` (JSON-serialisable), in rank order, on every rank.

    Travels as UTF-8 JSON in a byte tensor: nothing is unpickled from another process.
    """
    world = dist.get_world_size(group)
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).to(device)
    size = torch.tensor([data.numel()], dtype=torch.long, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    gathered = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return [
        json.loads(bytes(g[: int(s.item())].cpu().tolist()).decode())
        for g, s in zip(gathered, sizes, strict=True)
    ]
