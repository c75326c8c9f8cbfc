"""A layout's grid as one torch ``DeviceMesh``: the runtime half of :mod:`distml.layout`."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from distml.layout import ORDER, Layout


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """Plain data parallelism gets a one-dimensional ``dp`` mesh; any other layout all four
    dimensions, sizes of one included, so that ``mesh["tp"]`` always exists."""
    if not layout.model_parallel:
        return init_device_mesh(device_type, (layout.dp,), mesh_dim_names=("dp",))
    sizes = tuple(layout.as_dict().values())
    return init_device_mesh(device_type, sizes, mesh_dim_names=ORDER)
