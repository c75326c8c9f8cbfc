"""A model as a replica serves it: the architecture found by name (or from a run's config), the
weights found as for any other use of a run (:func:`distml.train.checkpoint.resolve_weights`) and
read from safetensors or a DCP checkpoint, never from a pickle, and a forward pass without
autograd.

A convolutional model that takes images (a 4-D input, N x C x H x W) is served in
channels-last memory format, weights and inputs alike: oneDNN's CPU convolutions and cuDNN's
tensor-core ones run faster on it, for the same values up to rounding
(``benchmarks/serving_protocols.py`` times both formats on the digits CNN).

>>> served = load_served_model("runs/digits", model="digits-cnn")  # doctest: +SKIP
>>> served.predict(torch.zeros(3, 1, 8, 8)).shape                  # doctest: +SKIP
torch.Size([3, 10])
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from distml.config import ConfigError, read_toml
from distml.models.registry import ModelEntry, TensorSpec, model_entry
from distml.train.checkpoint import load_weights, resolve_weights


@dataclass
class ServedModel:
    name: str
    entry: ModelEntry
    module: nn.Module
    memory_format: torch.memory_format = torch.contiguous_format

    @torch.inference_mode()
    def predict(self, x: torch.Tensor) -> torch.Tensor:
        if self.memory_format is not torch.contiguous_format:
            x = x.contiguous(memory_format=self.memory_format)
        return self.module(x)

    def example(self) -> torch.Tensor:
        """One small valid input, for health checks through the real inference path."""
        shape = [1 if s == -1 else s for s in self.entry.input.shape]
        dtype = torch.int64 if self.entry.input.datatype.startswith("INT") else torch.float32
        return torch.zeros(shape, dtype=dtype)

    @property
    def input(self) -> TensorSpec:
        return self.entry.input

    @property
    def output(self) -> TensorSpec:
        return self.entry.output


def resolve_entry(weights: Path, model: str | None) -> ModelEntry:
    """``--model NAME`` wins; otherwise the ``[model]`` (a GPT) of the run's ``config.toml``.
    A digits run records no architecture (its script builds the model), hence the flag."""
    config = weights.parent / "config.toml"
    fields = read_toml(config, "config").get("model") if config.is_file() else None
    if fields is not None and not isinstance(fields, dict):
        raise ConfigError(f"{config}: [model] is a {type(fields).__name__}, not a table")
    name = model or ("gpt" if fields is not None else None)
    if name is None:
        raise ConfigError(
            f"{weights}: say which architecture it holds with --model (e.g. digits-cnn); "
            f"no [model] in {config}"
        )
    try:
        return model_entry(name, fields if name == "gpt" else None)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def load_served_model(
    checkpoint: Path | str, model: str | None = None, name: str | None = None
) -> ServedModel:
    weights = resolve_weights(checkpoint)
    entry = resolve_entry(weights, model)
    module = entry.build()
    load_weights(module, weights)  # refuses, with the names, weights that do not fit
    images = len(entry.input.shape) == 4 and any(p.dim() == 4 for p in module.parameters())
    layout = torch.channels_last if images else torch.contiguous_format
    return ServedModel(name or entry.name, entry, module.eval().to(memory_format=layout), layout)
