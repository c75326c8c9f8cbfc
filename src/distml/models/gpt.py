"""A GPT-style decoder: token and position embeddings, N pre-norm blocks of causal
self-attention and MLP, a final norm and an LM head. Plain PyTorch: no parallel code inside.

Parallel strategies are applied to it from outside (:mod:`distml.parallel`). Three choices make
that possible without touching this file:

- the blocks live in a ``ModuleDict`` keyed ``"0".."N-1"``, so a pipeline stage can delete the
  blocks it does not own and every parameter keeps its name (checkpoints reshard by name);
- ``embed``, ``pos``, ``norm`` and ``head`` may be set to ``None`` by a pipeline stage, and
  ``forward`` skips what is missing;
- q, k and v are separate projections and attention infers the number of heads from the
  projection's output width, so a column split over tensor-parallel ranks gives each rank whole
  heads (Megatron-LM, Shoeybi et al. 2019).

>>> cfg = GPTConfig(vocab_size=256, seq_len=16, layers=2, hidden=32, heads=4)
>>> GPT(cfg)(torch.zeros(3, 16, dtype=torch.long)).shape
torch.Size([3, 16, 256])
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from distml.config import GPTConfig


class CausalAttention(nn.Module):
    """softmax(q k^T / sqrt(d) + causal mask) v: the part of attention without parameters, a
    module of its own so that selective activation checkpointing can recompute just it."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.q = nn.Linear(cfg.hidden, cfg.hidden)
        self.k = nn.Linear(cfg.hidden, cfg.hidden)
        self.v = nn.Linear(cfg.hidden, cfg.hidden)
        self.core = CausalAttention()
        self.out = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: as many as this rank's share of the projection holds.
        q, k, v = (
            p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        y = self.core(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.up = nn.Linear(cfg.hidden, cfg.mlp_ratio * cfg.hidden)
        self.down = nn.Linear(cfg.mlp_ratio * cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos: nn.Embedding | None = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.layers)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(cfg.hidden)
        self.head: nn.Linear | None = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        self.apply(_init_weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (B, S) -> logits (B, S, V); a pipeline stage may take or give hidden
        states (B, S, H) instead, when it lacks the embeddings or the head."""
        if self.embed is not None:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.embed(x) + self.pos(positions)
        for block in self.blocks.values():
            x = block(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)
        return x


def _init_weights(module: nn.Module) -> None:
    # GPT-2's initialisation: N(0, 0.02) weights, zero biases.
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, averaged over every position of the batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


@torch.no_grad()
def generate(
    forward: Callable[[torch.Tensor], torch.Tensor],
    prompt: torch.Tensor,
    max_new_tokens: int,
    seq_len: int,
) -> torch.Tensor:
    """Greedy decoding: append the arg-max next token ``max_new_tokens`` times.

    ``forward`` maps token ids (B, T) to logits (B, T, V): a plain :class:`GPT`, or a sharded
    one's forward through its layout (``ctx.forward``). The context is the last ``seq_len``
    tokens. No key-value cache: each token recomputes the window, which keeps every layout's
    forward the plain one.

    >>> model = GPT(GPTConfig(vocab_size=256, seq_len=8, layers=1, hidden=16, heads=2))
    >>> generate(model, torch.zeros(1, 3, dtype=torch.long), 4, seq_len=8).shape
    torch.Size([1, 7])
    """
    tokens = prompt
    for _ in range(max_new_tokens):
        logits = forward(tokens[:, -seq_len:])
        tokens = torch.cat([tokens, logits[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
    return tokens
