"""Greedy generation with a GPT laid out over several processes (tensor or pipeline parallel),
for a model too big for one device: every rank holds its share, and the tokens equal those of
one process running the whole model.

>>> text = generate_text("runs/gpt", "def ", max_new_tokens=16, nproc=2, mesh={"tp": 2})
... # doctest: +SKIP
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from distml.config import ConfigError, GPTConfig
from distml.launch.api import launch
from distml.models.gpt import GPT, generate
from distml.runtime.context import Context


def resolve_checkpoint(path: Path | str) -> tuple[Path, GPTConfig]:
    """A run folder (its ``model.safetensors`` and the ``[model]`` of its ``config.toml``, or
    the GPT defaults), or a safetensors file beside such a ``config.toml``."""
    path = Path(path)
    weights = path / "model.safetensors" if path.is_dir() else path
    if not weights.is_file():
        raise ConfigError(f"no exported model at {weights}")
    config = weights.parent / "config.toml"
    model: dict = {}
    if config.is_file():
        model = tomllib.loads(config.read_text()).get("model", {})
    try:
        return weights, GPTConfig(**model)
    except ValueError as exc:
        raise ConfigError(f"{config}: [model] is not a GPT config: {exc}") from None


def load_gpt(weights: Path, cfg: GPTConfig) -> GPT:
    """The plain GPT with the exported parameters, which must match ``cfg`` exactly."""
    model = GPT(cfg)
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError) as exc:
        raise ConfigError(f"{weights} is not a readable safetensors file: {exc}") from None
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ConfigError(f"{weights} does not fit the model config {cfg}: {exc}") from None
    return model


def _generate_worker(
    ctx: Context, weights: str, cfg: dict, prompt: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    cfg_ = GPTConfig(**cfg)
    model, _ = ctx.setup(load_gpt(Path(weights), cfg_), None)
    tokens = generate(ctx.forward, torch.tensor(prompt), max_new_tokens, cfg_.seq_len)
    return tokens.tolist()


def generate_tokens(
    checkpoint: Path | str,
    prompt: list[list[int]],
    max_new_tokens: int,
    *,
    nproc: int = 1,
    mesh: dict[str, int] | None = None,
    **settings,
) -> list[list[int]]:
    """Token ids of ``prompt`` (one list per sequence) followed by the generated ones."""
    weights, cfg = resolve_checkpoint(checkpoint)
    if nproc == 1 and not mesh:
        model = load_gpt(weights, cfg).eval()
        return generate(model, torch.tensor(prompt), max_new_tokens, cfg.seq_len).tolist()
    settings.setdefault("telemetry", {"progress": False})
    return launch(
        _generate_worker,
        str(weights),
        cfg.model_dump(),
        prompt,
        max_new_tokens,
        nproc=nproc,
        mesh=mesh,
        model=cfg.model_dump(),
        **settings,
    )


def generate_text(checkpoint: Path | str, prompt: str, max_new_tokens: int, **kwargs) -> str:
    """Byte-level text in, text out (the GPT of ``examples/gpt`` reads bytes)."""
    ids = [list(prompt.encode())]
    out = generate_tokens(checkpoint, ids, max_new_tokens, **kwargs)
    return bytes(out[0]).decode(errors="replace")
