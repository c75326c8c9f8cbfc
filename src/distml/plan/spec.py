"""What the planner plans: a GPT-style model's shape, how it is trained, and the layout that
spreads it over devices; and the two facts of a layout that the cost model and the calibrated
timings share (a stage's parameters, the pipeline bubble)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from distml.config import Precision, Recompute
from distml.layout import Layout

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class ModelSpec:
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    params: float | None = None  # None: the blocks' weights and the embedding(s)
    # How the model is written. The defaults are Megatron-LM's GPT, the model of the papers:
    # dropout, unfused attention, vocabulary split over tensor ranks, the output layer tied to
    # the input embedding, an MLP of 4h with biases, as many key/value heads as query heads.
    dropout: bool = True
    fused_attention: bool = False
    vocab_parallel: bool = True
    embedding_params: float | None = None  # on the first stage; None: V*h
    ffn_hidden: int | None = None  # None: 4h
    kv_heads: int | None = None  # grouped-query attention; None: as many as heads
    gated_mlp: bool = False  # SwiGLU: three h x ffn weights instead of two
    tied_embeddings: bool = True
    bias: bool = True

    @property
    def ffn(self) -> int:
        return 4 * self.hidden if self.ffn_hidden is None else self.ffn_hidden

    @property
    def kv_hidden(self) -> int:
        """Width of the keys (and of the values): kv heads x head dimension."""
        return self.hidden * (self.kv_heads or self.heads) // self.heads

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated_mlp else 2

    @property
    def layer_weights(self) -> float:
        """One block's matrices: q and the output projection (h x h each), k and v, the MLP."""
        h = self.hidden
        return 2 * h * h + 2 * h * self.kv_hidden + self.mlp_matrices * h * self.ffn

    @property
    def n_params(self) -> float:
        if self.params is not None:
            return self.params
        embeddings = 1 if self.tied_embeddings else 2
        return self.layers * self.layer_weights + embeddings * self.vocab * self.hidden

    def weight_shapes(self) -> list[tuple[int, ...]]:
        """Each parameter's shape, as a Megatron-style block writes them (q, k, v and the output
        projection apart, the MLP's matrices, biases and two norms) and the embedding(s): what
        decides how much PowerSGD compresses (:func:`distml.plan.sync.powersgd_elements`)."""
        h, f, kv = self.hidden, self.ffn, self.kv_hidden
        block: list[tuple[int, ...]] = [(h, h), (kv, h), (kv, h), (h, h)]
        block += [(f, h)] * (self.mlp_matrices - 1) + [(h, f)]
        if self.bias:
            block += [(h,), (kv,), (kv,), (h,)] + [(f,)] * (self.mlp_matrices - 1) + [(h,)]
        block += [(h,)] * 4  # two norms, weight and bias
        embeddings = [(self.vocab, h)] * (1 if self.tied_embeddings else 2)
        return embeddings + block * self.layers

    @property
    def layer_params(self) -> float:
        """One block: its matrices, their biases and two norms (12h^2 + 13h for the GPT)."""
        h, f = self.hidden, self.ffn
        biases = (2 * h + 2 * self.kv_hidden + (self.mlp_matrices - 1) * f + h) if self.bias else 0
        return self.layer_weights + biases + 4 * h

    @property
    def edge_params(self) -> tuple[float, float]:
        """The parameters outside the blocks: (first stage's, last stage's)."""
        rest = max(0.0, self.n_params - self.layers * self.layer_params)
        first = self.vocab * self.hidden if self.embedding_params is None else self.embedding_params
        first = min(first, rest)
        return first, rest - first


@dataclass(frozen=True)
class Training:
    global_batch: int
    micro_batch: int = 1
    precision: Precision = "bf16"
    optimizer: Literal["adam", "sgd"] = "adam"
    recompute: Recompute = "none"
    sequence_parallel: bool = False
    # Which communication a GPU step hides behind computation (the device model only):
    # data-parallel gradients during the backward pass (DDP buckets, FSDP, Megatron's
    # --overlap-grad-reduce) or after it; tensor-parallel collectives behind the GEMMs that
    # produce or consume them (Megatron's --tp-comm-overlap, torchtitan's AsyncTP) or not.
    dp_overlap: bool = True
    tp_overlap: bool = False
    grad_reduce_fp32: bool = False  # gradients travel as fp32 (main grads), not as parameters
    # Megatron's weight-gradient GEMMs accumulate into the fp32 gradients; elsewhere (DeepSpeed,
    # FSDP keeping gradients across micro-batches) each micro-batch adds its own in HBM.
    fused_grad_accumulation: bool = True


def stage_params(model: ModelSpec, layout: Layout, stage: int) -> float:
    """Parameters one tensor rank of pipeline stage ``stage`` holds: its share of the blocks,
    plus the embedding on the first stage and the output layer on the last, split over the
    tensor ranks only when the vocabulary is."""
    first, last = model.edge_params
    edge = (first if stage == 0 else 0.0) + (last if stage == layout.pp - 1 else 0.0)
    blocks = model.layers / layout.pp * model.layer_params
    return blocks / layout.tp + edge / (layout.tp if model.vocab_parallel else 1)


def bubble_fraction(layout: Layout, microbatches: int) -> float:
    """Idle share of the pipeline: bubble / (ideal + bubble)."""
    p, m = layout.pp, microbatches
    ratio = (p - 1) / (m * (layout.chunks if layout.schedule == "interleaved" else 1))
    return ratio / (1 + ratio)
