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
    params: float | None = None  # None: 12*l*h^2 + V*h (blocks and embedding)
    # How the model is written, as far as memory goes. The defaults are Megatron-LM's GPT, the
    # model of the papers: dropout, unfused attention, vocabulary split over tensor ranks, and
    # the output layer tied to the input embedding.
    dropout: bool = True
    fused_attention: bool = False
    vocab_parallel: bool = True
    embedding_params: float | None = None  # on the first stage; None: V*h

    @property
    def n_params(self) -> float:
        if self.params is not None:
            return self.params
        return 12 * self.layers * self.hidden**2 + self.vocab * self.hidden

    @property
    def layer_params(self) -> float:
        """One block: four h x h and two h x 4h weights, their biases and two norms."""
        return 12 * self.hidden**2 + 13 * self.hidden

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
