"""A cluster file that describes a named GPU cluster, for planning before renting it.

``distml bench`` writes a cluster file of what it measured (a ``[device]`` table of rates);
this is the other kind, a description in the terms of :mod:`distml.plan.devices`::

    name = "64 x H100, NDR"
    device = "h100"            # a100, a100-40gb, h100, h200, b200
    devices = 64
    devices_per_node = 8       # optional: the network's
    network = "dgx-h100"       # optional: the device's usual node

    [links]                    # optional: what this cluster's fabric does differently
    nic_gbps = 200             # Gb/s a GPU between nodes
    nic_efficiency = 0.9       # NCCL bus bandwidth over line rate
    nvlink_busbw_gbs = 400     # NCCL all-reduce bus bandwidth inside a node, GB/s
"""

from __future__ import annotations

import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from distml.plan.cost_model import Cluster, named_device
from distml.plan.devices import CHIPS, DEFAULT_NETWORK, NETWORKS


class Links(BaseModel):
    model_config = ConfigDict(extra="forbid")

    nic_gbps: float | None = Field(None, gt=0)
    nic_efficiency: float | None = Field(None, gt=0, le=1)
    nvlink_busbw_gbs: float | None = Field(None, gt=0)
    intra_latency_us: float | None = Field(None, ge=0)
    inter_latency_us: float | None = Field(None, ge=0)


class ClusterDescription(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = ""
    device: str
    devices: int = Field(gt=0)
    devices_per_node: int | None = Field(None, gt=0)
    network: str | None = None
    links: Links = Links()


def is_description(data: dict[str, Any]) -> bool:
    """A description names its device; a measured file has a ``[device]`` table."""
    return isinstance(data.get("device"), str)


def cluster_from_description(data: dict[str, Any]) -> Cluster:
    try:
        desc = ClusterDescription.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"{where}: {first['msg']}") from None
    if desc.device not in CHIPS:
        raise ValueError(f"device {desc.device!r} is not one of: {', '.join(CHIPS)}")
    net_name = desc.network or DEFAULT_NETWORK[desc.device]
    if net_name not in NETWORKS:
        raise ValueError(f"network {net_name!r} is not one of: {', '.join(NETWORKS)}")
    net = NETWORKS[net_name]
    links = desc.links
    if links.nic_gbps is not None:
        net = net.with_nic(links.nic_gbps)
    changes: dict[str, float] = {}
    if links.nic_efficiency is not None:
        changes["nic_efficiency"] = links.nic_efficiency
    if links.nvlink_busbw_gbs is not None:
        changes["nvlink_busbw"] = links.nvlink_busbw_gbs * 1e9
    if links.intra_latency_us is not None:
        changes["intra_latency_s"] = links.intra_latency_us * 1e-6
    if links.inter_latency_us is not None:
        changes["inter_latency_s"] = links.inter_latency_us * 1e-6
    net = replace(net, **changes)
    per_node = desc.devices_per_node or net.gpus_per_node
    return Cluster(
        named_device(CHIPS[desc.device]), desc.devices, per_node, network=net, name=desc.name
    )


def read_description(path: Path) -> Cluster:
    """A :class:`Cluster` from a description file (ValueError, naming the file, if bad)."""
    try:
        return cluster_from_description(tomllib.loads(Path(path).read_text()))
    except (OSError, tomllib.TOMLDecodeError, ValueError) as exc:
        raise ValueError(f"cluster file {path}: {exc}") from None
