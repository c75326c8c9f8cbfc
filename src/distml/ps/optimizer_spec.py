"""A worker's optimizer, described as data so that a server can build the same one.

A server builds only the optimizers of an allow-list, from typed and bounded options: a
description comes from the network, and a setting that cannot step (a learning rate that is a
string or negative, a closure-driven or sparse optimizer, a CUDA-graph option on a CPU shard)
is refused when the shard is initialised, never found out push after push. A server never runs
code that a worker sent.

>>> spec = validate_optimizer_spec({"name": "SGD", "groups": [{"params": ["w"], "lr": 0.1}]})
>>> spec["groups"][0]
{'params': ['w'], 'lr': 0.1}
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import torch
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    create_model,
)

from distml.config import describe_errors

MAX_GROUPS = 4096
MAX_NAMES = 2**20
MAX_SPEC_BYTES = 4 * 2**20  # as much as a safetensors header holds
FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _off(value: bool) -> bool:
    if value:
        raise ValueError("a parameter server steps on the CPU without autograd or CUDA graphs")
    return value


Rate = Annotated[float, Field(strict=True, gt=0, allow_inf_nan=False)]
NonNegative = Annotated[float, Field(strict=True, ge=0, allow_inf_nan=False)]
Beta = Annotated[float, Field(strict=True, ge=0, lt=1)]
Decay = Annotated[float, Field(strict=True, ge=0, le=1)]
Off = Annotated[StrictBool, AfterValidator(_off)]
Name = Annotated[str, Field(min_length=1, max_length=1024)]


class _Group(BaseModel):
    """Options every allowed optimizer shares. An option left out takes torch's default.

    ``foreach`` and ``fused`` choose an implementation, not the arithmetic; ``initial_lr`` is a
    learning-rate scheduler's note on the worker and is dropped."""

    model_config = ConfigDict(extra="forbid")

    params: list[Name] = Field(max_length=MAX_NAMES)
    lr: Rate = 1e-3
    weight_decay: NonNegative = 0.0
    maximize: StrictBool = False
    foreach: StrictBool | None = None
    differentiable: Off = False
    initial_lr: Rate = 1e-3


class _Capturable(_Group):
    capturable: Off = False


class _SGD(_Group):
    momentum: Beta = 0.0
    dampening: Decay = 0.0
    nesterov: StrictBool = False
    fused: StrictBool | None = None


class _Adam(_Capturable):
    betas: tuple[Beta, Beta] = (0.9, 0.999)
    eps: Rate = 1e-8
    amsgrad: StrictBool = False
    decoupled_weight_decay: StrictBool = False
    fused: StrictBool | None = None


class _Adagrad(_Group):
    lr_decay: NonNegative = 0.0
    initial_accumulator_value: NonNegative = 0.0
    eps: Rate = 1e-10
    fused: StrictBool | None = None


class _RMSprop(_Capturable):
    alpha: Decay = 0.99
    eps: Rate = 1e-8
    momentum: Beta = 0.0
    centered: StrictBool = False


class _Adadelta(_Capturable):
    rho: Decay = 0.9
    eps: Rate = 1e-6


class _Adamax(_Capturable):
    betas: tuple[Beta, Beta] = (0.9, 0.999)
    eps: Rate = 1e-8


class _NAdam(_Adamax):
    momentum_decay: NonNegative = 4e-3
    decoupled_weight_decay: StrictBool = False


class _RAdam(_Adamax):
    decoupled_weight_decay: StrictBool = False


# The optimizers a shard applies: each steps on a gradient alone (no closure, as LBFGS needs;
# dense, unlike SparseAdam) with parameters of every dtype in FLOAT_DTYPES.
GROUPS: dict[str, type[_Group]] = {
    "SGD": _SGD,
    "Adam": _Adam,
    "AdamW": _Adam,
    "Adagrad": _Adagrad,
    "RMSprop": _RMSprop,
    "Adadelta": _Adadelta,
    "Adamax": _Adamax,
    "NAdam": _NAdam,
    "RAdam": _RAdam,
}
_SPECS = {
    name: create_model(
        f"{name}Spec",
        __config__=ConfigDict(extra="forbid"),
        name=(Literal[name], ...),
        groups=(list[group], Field(min_length=1, max_length=MAX_GROUPS)),
    )
    for name, group in GROUPS.items()
}
_DROPPED = {"initial_lr"}


def validate_optimizer_spec(raw: Any) -> dict[str, Any]:
    """The description ``raw`` (parsed JSON) with every option checked, as
    ``{"name", "groups": [{"params", ...options given}]}``; ``ValueError`` naming what is wrong."""
    if not isinstance(raw, dict):
        raise ValueError(f"an optimizer description is a JSON object, got {type(raw).__name__}")
    name = raw.get("name")
    if not isinstance(name, str) or name not in _SPECS:
        raise ValueError(
            f"unknown optimizer {str(name)[:64]!r}: a parameter server applies {', '.join(GROUPS)}"
        )
    try:
        spec = _SPECS[name].model_validate(raw)
    except ValidationError as exc:
        raise ValueError(f"bad {name} options: {describe_errors(exc, 3)}") from None
    groups = [g.model_dump(mode="json", exclude_unset=True, exclude=_DROPPED) for g in spec.groups]
    names = [n for g in groups for n in g["params"]]
    if len(set(names)) < len(names):
        raise ValueError("a parameter named twice in the optimizer's groups")
    return {"name": name, "groups": groups}


def _option(value: Any) -> Any:
    """``value`` as JSON (a learning rate held as a one-element tensor, as its number)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, list | tuple):
        return [_option(v) for v in value]
    return value


def describe_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, Any]:
    """``{"name": "SGD", "groups": [{"params": [names...], "lr": ..., ...}]}``; ``names`` maps
    ``id(parameter)`` to its name in the model. A key of a group that is no option of the
    optimizer (a user's own tag) is left out; an optimizer that a parameter server cannot
    apply is refused here, before anything is sent."""
    cls = type(optimizer)
    if cls.__name__ not in GROUPS or getattr(torch.optim, cls.__name__, None) is not cls:
        raise ValueError(
            f"a parameter server applies {', '.join(GROUPS)} of torch.optim; got {cls.__qualname__}"
        )
    known = set(GROUPS[cls.__name__].model_fields) - {"params"}
    groups = []
    for group in optimizer.param_groups:
        options = {k: _option(v) for k, v in group.items() if k in known}
        groups.append({"params": [names[id(p)] for p in group["params"]], **options})
    return validate_optimizer_spec({"name": cls.__name__, "groups": groups})


def build_optimizer(spec: Any, params: dict[str, torch.Tensor]) -> torch.optim.Optimizer:
    """The optimizer ``spec`` describes, over the named ``params`` this server holds (a group
    keeps the names it has here; a group with none here is left out). ``spec`` is validated
    first, and the optimizer takes a trial step on small stand-ins of the same dtypes, so that
    a setting that cannot step is refused now (``ValueError``), not at every push."""
    spec = validate_optimizer_spec(spec)
    cls = getattr(torch.optim, spec["name"])
    groups = []
    for group in spec["groups"]:
        mine = [params[n] for n in group["params"] if n in params]
        if mine:
            groups.append({**group, **_implementation(group), "params": mine})
    if not groups:
        raise ValueError("the optimizer names none of this shard's parameters")
    for param in (p for g in groups for p in g["params"]):
        if param.dtype not in FLOAT_DTYPES:
            raise ValueError(f"a parameter of dtype {param.dtype}; a shard holds {FLOAT_DTYPES}")
    _trial_step(cls, groups)
    try:
        return cls(groups)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"cannot build {spec['name']}: {exc}") from None


def _implementation(group: dict[str, Any]) -> dict[str, Any]:
    """Where the worker left the choice to torch, the multi-tensor (``foreach``) step: torch
    picks it only for CUDA tensors, but on a shard's CPU tensors it also takes one call for
    all of them instead of one per tensor (the same arithmetic, a fraction of the overhead)."""
    if group.get("foreach") is None and not group.get("fused"):
        return {"foreach": True}
    return {}


def _trial_step(cls: type[torch.optim.Optimizer], groups: list[dict[str, Any]]) -> None:
    """Two steps of ``cls`` with ``groups``' options on one-element parameters of each dtype the
    groups hold (every failure torch can raise from a setting, found on a few bytes)."""
    trial = []
    for group in groups:
        dtypes = {p.dtype: None for p in group["params"]}
        stand_ins = [torch.nn.Parameter(torch.ones(1, dtype=d)) for d in dtypes]
        trial.append({**group, "params": stand_ins})
    try:
        optimizer = cls(trial)
        for _ in range(2):
            for group in trial:
                for p in group["params"]:
                    p.grad = torch.ones_like(p)
            optimizer.step()
    except Exception as exc:  # whatever torch raises, the setting cannot step: refused
        options = {k: v for k, v in groups[0].items() if k != "params"}
        raise ValueError(
            f"{cls.__name__} with {json.dumps(options)[:200]} cannot step: {exc}"
        ) from None
