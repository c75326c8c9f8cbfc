"""Collectives on a GPU cluster, charged on the links they cross.

Placement is Megatron's and torchtitan's (and :mod:`distml.layout`'s): ranks form the grid
pp x dp x fsdp x tp with tensor parallelism innermost, so a group of dimension X holds ranks
``stride(X)`` apart, and a node of g GPUs holds ``min(size, g / stride)`` of its members.

A group of n ranks with k in each of N nodes runs hierarchically (NCCL's rings over NVLink
inside a node and one adapter per GPU between nodes): an all-reduce of B bytes is a
reduce-scatter inside the node, an all-reduce of B/k between nodes on each of the k
adapters, and an all-gather inside the node,

    2 (k-1)/k B / nvlink_busbw + 2 (N-1)/N B / (k nic_bw nic_efficiency) + latency,

(Patarasuk and Yuan 2009 for the ring's 2(n-1)/n; the bus bandwidths are NCCL-tests figures,
:mod:`distml.plan.devices`). A reduce-scatter or all-gather moves half of that. The latency
term is one collective's inside the node plus a tree's log2(N) hops between nodes: NCCL picks
a tree between nodes where the ring's 2(N-1) hops would cost more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from distml.layout import ORDER, Layout
from distml.plan.devices import Network


@dataclass(frozen=True)
class Group:
    """Where a parallel dimension's group sits: ``size`` ranks, ``per_node`` in each node."""

    size: int
    per_node: int

    @property
    def nodes(self) -> int:
        return max(1, self.size // self.per_node)


def group(layout: Layout, dim: str, gpus_per_node: int) -> Group:
    """The group of grid dimension ``dim`` ("pp", "dp", "fsdp", "tp"), or of all data-parallel
    ranks ("data": dp x fsdp, adjacent in the grid)."""
    sizes = layout.as_dict()
    if dim == "data":
        size = layout.data_parallel
        inner = ORDER[ORDER.index("fsdp") + 1 :]
    else:
        size = sizes[dim]
        inner = ORDER[ORDER.index(dim) + 1 :]
    stride = math.prod(sizes[d] for d in inner)
    per_node = max(1, min(size, gpus_per_node // stride)) if stride < gpus_per_node else 1
    return Group(size, per_node)


def _bandwidth_s(net: Network, grp: Group, nbytes: float, factor: float) -> float:
    """The bandwidth part of a collective whose ring moves ``factor * (n-1)/n * B``."""
    k, n_nodes = grp.per_node, grp.nodes
    inside = factor * (k - 1) / k * nbytes / net.nvlink_busbw if k > 1 else 0.0
    between = 0.0
    if n_nodes > 1:
        between = factor * (n_nodes - 1) / n_nodes * nbytes / k
        between /= net.nic_bw * net.nic_efficiency
    return inside + between


def latency_s(net: Network, grp: Group) -> float:
    between = net.inter_latency_s * math.ceil(math.log2(grp.nodes)) if grp.nodes > 1 else 0.0
    return (net.intra_latency_s if grp.per_node > 1 else 0.0) + between


def collective_s(net: Network, name: str, nbytes: float, grp: Group) -> float:
    """``all_reduce``, ``reduce_scatter`` or ``all_gather`` of ``nbytes`` (each rank's full
    buffer) over ``grp``."""
    if grp.size <= 1 or nbytes <= 0:
        return 0.0
    factor = 2.0 if name == "all_reduce" else 1.0
    return _bandwidth_s(net, grp, nbytes, factor) + latency_s(net, grp)


def p2p_s(net: Network, nbytes: float, inside_node: bool) -> float:
    """One send between neighbouring pipeline stages."""
    if nbytes <= 0:
        return 0.0
    if inside_node:
        return nbytes / net.nvlink_busbw + net.intra_latency_s
    return nbytes / (net.nic_bw * net.nic_efficiency) + net.inter_latency_s
