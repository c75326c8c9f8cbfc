"""Models by name, so that a served or federated model is chosen by a word and never by code
that travels: each name maps to a builder and the signature of its one input and one output.

>>> entry = model_entry("digits-cnn")
>>> entry.build()(torch.zeros(2, *entry.input.shape[1:])).shape
torch.Size([2, 10])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch  # noqa: F401 (the doctest uses it)
from torch import nn

from distml.config import GPTConfig
from distml.models.cnn import DigitsCNN
from distml.models.gpt import GPT
from distml.models.mlp import MLP


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a model's signature: -1 in ``shape`` is a free size (the first is the
    batch), at most ``longest`` where that names a bound for it; ``low``/``high`` bound integer
    inputs such as token ids (``high`` exclusive)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    low: int | None = None
    high: int | None = None
    longest: tuple[int | None, ...] = ()


@dataclass(frozen=True)
class ModelEntry:
    """One model of the registry: how to build it, and the signature of its one input and one
    output, which a replica serves and checks requests against."""

    name: str
    build: Callable[[], nn.Module]
    input: TensorSpec
    output: TensorSpec


def _digits(name: str, build: Callable[[], nn.Module]) -> Callable[[dict[str, Any]], ModelEntry]:
    def entry(config: dict[str, Any]) -> ModelEntry:
        if config:
            raise ValueError(f"{name} takes no model config, got {sorted(config)}")
        return ModelEntry(
            name,
            build,
            TensorSpec("input", "FP32", (-1, 1, 8, 8)),
            TensorSpec("logits", "FP32", (-1, 10)),
        )

    return entry


def _gpt(config: dict[str, Any]) -> ModelEntry:
    cfg = GPTConfig(**config)
    return ModelEntry(
        "gpt",
        lambda: GPT(cfg),
        # Sequences of one request share a length; up to seq_len tokens each.
        TensorSpec(
            "input_ids", "INT64", (-1, -1), low=0, high=cfg.vocab_size, longest=(None, cfg.seq_len)
        ),
        TensorSpec("logits", "FP32", (-1, -1, cfg.vocab_size)),
    )


MODELS: dict[str, Callable[[dict[str, Any]], ModelEntry]] = {
    "digits-mlp": _digits("digits-mlp", lambda: MLP((64, 32, 10))),
    "digits-cnn": _digits("digits-cnn", DigitsCNN),
    "gpt": _gpt,
}


def model_entry(name: str, config: dict[str, Any] | None = None) -> ModelEntry:
    """The builder and signature of architecture ``name``; ``config`` sizes it (GPT only)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {sorted(MODELS)}")
    return MODELS[name](dict(config or {}))
