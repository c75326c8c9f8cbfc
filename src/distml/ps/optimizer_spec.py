"""A worker's optimizer, described as data so that a server can build the same one.

Only classes of ``torch.optim`` are accepted, by name, with their options as JSON values: a
server never runs code that a worker sent.
"""

from __future__ import annotations

import json
from typing import Any

import torch

_JSON_SCALARS = (bool, int, float, str, type(None))


def _jsonable(value: Any) -> bool:
    if isinstance(value, _JSON_SCALARS):
        return True
    return isinstance(value, list | tuple) and all(isinstance(v, _JSON_SCALARS) for v in value)


def describe_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, Any]:
    """``{"name": "SGD", "groups": [{"params": [names...], "lr": ..., ...}]}``; ``names`` maps
    ``id(parameter)`` to its name in the model."""
    cls = type(optimizer)
    if getattr(torch.optim, cls.__name__, None) is not cls:
        raise ValueError(
            f"a parameter server applies torch.optim optimizers; got {cls.__qualname__}"
        )
    groups = []
    for group in optimizer.param_groups:
        options = {k: v for k, v in group.items() if k != "params" and _jsonable(v)}
        groups.append({"params": [names[id(p)] for p in group["params"]], **options})
    return {"name": cls.__name__, "groups": groups}


def build_optimizer(spec: dict[str, Any], params: dict[str, torch.Tensor]) -> torch.optim.Optimizer:
    """The optimizer ``spec`` describes, over the named ``params`` this server holds (a group
    keeps the names it has here; a group with none here is left out)."""
    name = spec.get("name")
    cls = getattr(torch.optim, name, None) if isinstance(name, str) else None
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(f"unknown optimizer {name!r}: name a class of torch.optim")
    groups = []
    for group in spec.get("groups", []):
        mine = [params[n] for n in group.get("params", []) if n in params]
        if mine:
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": mine})
    if not groups:
        raise ValueError("the optimizer names none of this shard's parameters")
    try:
        return cls(groups)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"cannot build {name} from {json.dumps(spec)[:200]}: {exc}") from None
