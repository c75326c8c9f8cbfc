"""A model as a replica serves it: the architecture found by name (or from a run's config), the
weights read from safetensors only, and a forward pass without autograd.

>>> served = load_served_model("runs/digits", model="digits-cnn")  # doctest: +SKIP
>>> served.predict(torch.zeros(3, 1, 8, 8)).shape                  # doctest: +SKIP
torch.Size([3, 10])
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from distml.config import ConfigError, read_toml
from distml.models.registry import ModelSpec, TensorSpec, model_spec
from distml.net.untrusted import bounded_json

MAX_SUMMARY_BYTES = 2**20  # a run's summary.json is a few KB


@dataclass
class ServedModel:
    name: str
    spec: ModelSpec
    module: nn.Module

    @torch.inference_mode()
    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    def example(self) -> torch.Tensor:
        """One small valid input, for health checks through the real inference path."""
        shape = [1 if s == -1 else s for s in self.spec.input.shape]
        dtype = torch.int64 if self.spec.input.datatype.startswith("INT") else torch.float32
        return torch.zeros(shape, dtype=dtype)

    @property
    def input(self) -> TensorSpec:
        return self.spec.input

    @property
    def output(self) -> TensorSpec:
        return self.spec.output


def resolve_weights(checkpoint: Path) -> Path:
    """A run folder's exported parameters (``summary.json``'s ``export``, else
    ``model.safetensors``), or the safetensors file given."""
    if not checkpoint.is_dir():
        if not checkpoint.is_file():
            raise ConfigError(f"no checkpoint at {checkpoint}")
        return checkpoint
    summary = checkpoint / "summary.json"
    if summary.is_file():
        export = _export_of(summary)
        if export and Path(export).is_file():
            return Path(export)
    weights = checkpoint / "model.safetensors"
    if not weights.is_file():
        raise ConfigError(f"{checkpoint} holds no exported model (model.safetensors)")
    return weights


def _export_of(summary: Path) -> str | None:
    """The ``export`` a run's ``summary.json`` names; a folder handed over by someone else may
    hold any file there, so it is read bounded and a bad one is a :class:`ConfigError`."""
    try:
        with open(summary, "rb") as f:
            data = f.read(MAX_SUMMARY_BYTES + 1)
        record = bounded_json(data, max_bytes=MAX_SUMMARY_BYTES, max_depth=64)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {summary}: {exc}") from None
    export = record.get("export") if isinstance(record, dict) else None
    if export is not None and not isinstance(export, str):
        raise ConfigError(f"{summary}: export is a {type(export).__name__}, not a path")
    return export


def resolve_spec(weights: Path, model: str | None) -> ModelSpec:
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
        return model_spec(name, fields if name == "gpt" else None)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def load_served_model(
    checkpoint: Path | str, model: str | None = None, name: str | None = None
) -> ServedModel:
    weights = resolve_weights(Path(checkpoint))
    spec = resolve_spec(weights, model)
    module = spec.build()
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError) as exc:
        raise ConfigError(f"{weights} is not a readable safetensors file: {exc}") from None
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ConfigError(f"{weights} does not fit the {spec.name} architecture: {exc}") from None
    return ServedModel(name or spec.name, spec, module.eval())
