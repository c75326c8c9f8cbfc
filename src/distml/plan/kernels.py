"""How long one transformer layer's kernels take on a GPU, by the shape of each kernel.

- A GEMM runs as 128x128 tiles of its output, one wave of tiles per pass over the SMs (tile
  and wave quantization, NVIDIA's Matrix Multiplication Background guide, section 3): an
  m x n output pays for whole tiles and whole waves, each at the best matmul rate the chip
  reaches (:attr:`Chip.mamf`). Its operands and result stream through HBM at the achievable
  bandwidth; a GEMM too thin to reuse them is bound by that instead (the two combine as a
  smooth roofline), and every kernel pays a fixed launch-and-ramp cost
  (``tests/plan/test_gpu_model.py`` holds it to published cuBLASLt figures).
- Element-wise work (norms, GeLU/SwiGLU, dropout, residual adds, the loss over the
  vocabulary, Adam) moves its tensors through HBM at the achievable bandwidth. The tensors
  counted are those of Megatron-LM's fused kernels (bias-GeLU, bias-dropout-add, fused layer
  norm): per token of a layer, the norms read and write h values each, each
  bias-dropout-add reads two and writes one (plus a 1-byte mask with dropout), the activation
  reads and writes the MLP's hidden width. A backward pass moves about twice a forward's.
- Attention: a fused kernel (FlashAttention) computes the causal half of the scores at the
  published forward + backward rate of the chip; an unfused one runs two batched GEMMs over
  the whole s x s score matrix per head and streams it through the softmax (and dropout)
  kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from distml.plan.devices import Chip
from distml.plan.spec import BYTES, ModelSpec, Training

ROOFLINE_P = 2.0  # how sharply compute- and memory-bound time combine: sqrt(tc^2 + tm^2)
ADAM_BYTES = 32  # per local parameter: fp32 master, two moments and the gradient read and
# written back (28), the 16-bit weights written and the gradient's norm read (4)
MASK_BYTES = 1


def gemm_s(chip: Chip, m: float, n: float, k: float, dtype_bytes: int, batch: int = 1) -> float:
    """One (batched) GEMM of an m x k by a k x n matrix."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    tm, tn = chip.tile
    tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
    waves = math.ceil(tiles / chip.sms)
    per_sm = chip.peak("bf16" if dtype_bytes == 2 else "tf32") * chip.mamf * chip.sustained
    per_sm /= chip.sms
    compute = waves * 2 * tm * tn * k / per_sm
    memory = batch * dtype_bytes * (m * k + k * n + m * n) / chip.hbm_achievable
    memory /= chip.sustained
    both = (compute**ROOFLINE_P + memory**ROOFLINE_P) ** (1 / ROOFLINE_P)
    return both + chip.kernel_s


def stream_s(chip: Chip, nbytes: float, kernels: int = 1) -> float:
    """``kernels`` memory-bound kernels moving ``nbytes`` between them."""
    return nbytes / (chip.hbm_achievable * chip.sustained) + kernels * chip.kernel_s


@dataclass(frozen=True)
class LayerTime:
    """One layer, one micro-batch, on one tensor rank."""

    forward_s: float  # all of the forward
    backward_s: float  # all of the backward (without recomputation)
    recompute_s: float  # the forward work recomputed during the backward
    forward_gemm_s: float
    wgrad_s: float  # the weight-gradient GEMMs of the backward (what TP collectives hide behind)
    attention_s: float  # forward + backward of the attention core


def _linear(chip: Chip, tokens: float, n: float, k: float, e: int) -> tuple[float, float, float]:
    """Forward, input-gradient and weight-gradient GEMMs of a linear layer (k -> n)."""
    fwd = gemm_s(chip, tokens, n, k, e)
    dgrad = gemm_s(chip, tokens, k, n, e)
    wgrad = gemm_s(chip, k, n, tokens, e)
    return fwd, dgrad, wgrad


def attention_core_s(
    chip: Chip, model: ModelSpec, training: Training, tp: int
) -> tuple[float, float]:
    """(forward, backward) of softmax(q k^T) v for one micro-batch on one tensor rank."""
    s, b, h = model.seq, training.micro_batch, model.hidden
    e = BYTES[training.precision]
    heads = model.heads / tp
    d = h // model.heads
    if model.fused_attention:
        # FlashAttention's own count: forward 4*s^2*d a head, halved when causal; the
        # backward 2.5 forwards (it recomputes the scores).
        fwd_flops = 4 * s * s * d * heads * b / 2
        rate = chip.flash_attention_flops * chip.sustained
        return fwd_flops / rate + chip.kernel_s, 2.5 * fwd_flops / rate + chip.kernel_s
    batch = math.ceil(b * heads)
    scores = gemm_s(chip, s, s, d, e, batch) + gemm_s(chip, s, d, s, e, batch)
    elements = b * heads * s * s
    per_element = 2 * e + (2 * e + MASK_BYTES if model.dropout else 0)  # softmax, dropout
    fwd = scores + stream_s(chip, elements * per_element, 2 if model.dropout else 1)
    bwd = 2 * scores + stream_s(chip, 2 * elements * per_element, 2 if model.dropout else 1)
    return fwd, bwd


def elementwise_bytes(model: ModelSpec, training: Training, tp: int) -> float:
    """Bytes one layer's forward element-wise kernels move for one micro-batch on one rank."""
    tokens = model.seq * training.micro_batch
    e = BYTES[training.precision]
    h = model.hidden
    mask = MASK_BYTES / e if model.dropout else 0.0
    # two norms (read, write), two bias-dropout-adds (two reads, a write, a mask), per h
    replicated = 2 * 2 + 2 * (3 + mask)
    if training.sequence_parallel:
        replicated /= tp
    activation = (3 if model.gated_mlp else 2) * model.ffn / h / tp  # GeLU r+w; SwiGLU 2r+w
    return tokens * h * e * (replicated + activation)


def layer_time(chip: Chip, model: ModelSpec, training: Training, tp: int) -> LayerTime:
    """The kernels of one block (Megatron-LM's tensor-parallel split, Shoeybi et al. 2019)."""
    tokens = model.seq * training.micro_batch
    e = BYTES[training.precision]
    h, f = model.hidden, model.ffn
    linears = [
        _linear(chip, tokens, (h + 2 * model.kv_hidden) / tp, h, e),  # q, k, v
        _linear(chip, tokens, h, h / tp, e),  # output projection
        _linear(chip, tokens, (model.mlp_matrices - 1) * f / tp, h, e),  # up (and gate)
        _linear(chip, tokens, h, f / tp, e),  # down
    ]
    fwd_gemm = sum(x[0] for x in linears)
    dgrad = sum(x[1] for x in linears)
    wgrad = sum(x[2] for x in linears)
    att_f, att_b = attention_core_s(chip, model, training, tp)
    elem = elementwise_bytes(model, training, tp)
    elem_f = stream_s(chip, elem, 6)
    elem_b = stream_s(chip, 2 * elem, 8)
    forward = fwd_gemm + att_f + elem_f
    backward = dgrad + wgrad + att_b + elem_b
    if training.recompute == "full":
        recompute = forward
    elif training.recompute == "selective" and not model.fused_attention:
        recompute = att_f
    else:
        recompute = 0.0
    return LayerTime(forward, backward, recompute, fwd_gemm, wgrad, att_f + att_b)


def head_s(chip: Chip, model: ModelSpec, training: Training, tp: int) -> float:
    """The output layer and the loss, forward and backward, for one micro-batch: the logits
    GEMMs and the cross-entropy's passes over fp32 logits (about four reads and writes)."""
    tokens = model.seq * training.micro_batch
    e = BYTES[training.precision]
    vocab = model.vocab / (tp if model.vocab_parallel else 1)
    gemms = sum(_linear(chip, tokens, vocab, model.hidden, e))
    return gemms + stream_s(chip, 4 * 4 * tokens * vocab, 4)


def accumulate_s(chip: Chip, local_params: float) -> float:
    """Adding one micro-batch's 16-bit gradients into fp32 ones (read 4 + 2, write 4 bytes)."""
    return stream_s(chip, 10 * local_params)


def optimizer_s(chip: Chip, local_params: float) -> float:
    """Adam over the parameters a rank updates (its shard under ZeRO)."""
    return stream_s(chip, ADAM_BYTES * local_params, 4)
