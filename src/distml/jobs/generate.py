"""Greedy generation with a GPT laid out over several processes (tensor or pipeline parallel),
for a model too big for one device: every rank holds its share, and the tokens equal those of
one process running the whole model. Several prompts, of any lengths, are generated in batches
of prompts of one length (:func:`generate_batches`), the answers in input order.

>>> text = generate_text("runs/gpt", "def ", max_new_tokens=16, nproc=2, mesh={"tp": 2})
... # doctest: +SKIP
>>> generate_tokens("runs/gpt", [[100, 101], [102]], 8, nproc=2, mesh={"pp": 2})
... # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from distml.config import ConfigError, GPTConfig
from distml.launch.api import launch
from distml.models.gpt import GPT, generate
from distml.runtime.context import Context
from distml.train.checkpoint import (
    check_weights,
    load_weights,
    model_settings_near,
    resolve_weights,
)


def resolve_checkpoint(path: Path | str) -> tuple[Path, GPTConfig]:
    """Where the GPT's weights are, as for any model (:func:`resolve_weights`: a run folder, a
    checkpoint folder or a safetensors file), and its size: the ``[model]`` of the run's
    ``config.toml``, or the GPT defaults."""
    weights = resolve_weights(path)
    settings = model_settings_near(weights)
    try:
        return weights, GPTConfig(**settings)
    except ValueError as exc:
        raise ConfigError(f"{path}: [model] is not a GPT config: {exc}") from None


def load_gpt(weights: Path, cfg: GPTConfig) -> GPT:
    """The plain GPT with the weights at ``weights`` (whatever layout saved them), which must
    fit ``cfg`` exactly; every rank calls it when they are a DCP checkpoint."""
    model = GPT(cfg)
    load_weights(model, weights)
    return model


def check_prompts(prompts: list[list[int]], cfg: GPTConfig) -> None:
    """Refuse prompts the model cannot read: none, an empty one, or a token outside the
    vocabulary."""
    if not prompts:
        raise ConfigError("no prompts to generate from")
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ConfigError(f"prompt {i} is empty")
        bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ConfigError(
                f"prompt {i}: token {bad[0]} is outside the vocabulary 0..{cfg.vocab_size - 1}"
            )


def generate_batches(
    forward: Callable[[torch.Tensor], torch.Tensor],
    prompts: list[list[int]],
    max_new_tokens: int,
    seq_len: int,
    batch_size: int | None = None,
) -> list[list[int]]:
    """Each prompt followed by its generated tokens, in input order. Prompts of one length are
    generated together, ``batch_size`` at a time (default: all of them): the GPT has no padding
    mask, and a padded prompt would not continue as it does alone."""
    by_length: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(i)
    out: list[list[int]] = [[] for _ in prompts]
    for length in sorted(by_length):
        rows = by_length[length]
        step = batch_size or len(rows)
        for start in range(0, len(rows), step):
            chunk = rows[start : start + step]
            batch = torch.tensor([prompts[i] for i in chunk])
            tokens = generate(forward, batch, max_new_tokens, seq_len).tolist()
            for i, row in zip(chunk, tokens, strict=True):
                out[i] = row
    return out


def _generate_worker(
    ctx: Context,
    weights: str,
    cfg: dict,
    prompts: list[list[int]],
    max_new_tokens: int,
    batch_size: int | None,
) -> list[list[int]]:
    cfg_ = GPTConfig(**cfg)
    ctx.setup(load_gpt(Path(weights), cfg_), None)
    return generate_batches(ctx.forward, prompts, max_new_tokens, cfg_.seq_len, batch_size)


def generate_tokens(
    checkpoint: Path | str,
    prompt: list[list[int]],
    max_new_tokens: int,
    *,
    nproc: int = 1,
    mesh: dict[str, int] | None = None,
    batch_size: int | None = None,
    **settings,
) -> list[list[int]]:
    """Token ids of each prompt of ``prompt`` (one list per sequence, of any lengths) followed
    by the generated ones; see :func:`generate_batches` for ``batch_size``."""
    weights, cfg = resolve_checkpoint(checkpoint)
    check_prompts(prompt, cfg)
    if nproc == 1 and not mesh:
        model = load_gpt(weights, cfg).eval()
        return generate_batches(model, prompt, max_new_tokens, cfg.seq_len, batch_size)
    with torch.device("meta"):  # shapes only: refuse unfit weights here, once, not in every rank
        check_weights(GPT(cfg), weights)
    settings.setdefault("telemetry", {"progress": False})
    return launch(
        _generate_worker,
        str(weights),
        cfg.model_dump(),
        prompt,
        max_new_tokens,
        batch_size,
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
