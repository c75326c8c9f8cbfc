"""One optimizer step on a named GPU cluster: kernels by shape, collectives on their links, and
an explicit account of which communication overlaps computation.

Per micro-batch, a pipeline stage runs its layers forward and backward (:mod:`kernels`), the
embedding on the first stage and the output layer and loss on the last. On the critical path:

- tensor-parallel collectives (Megatron: two all-reduces forward and two backward per layer,
  or with sequence parallelism the same bytes as all-gathers and reduce-scatters; the forward
  ones again under full recomputation). The backward ones run beside the weight-gradient
  GEMMs (Megatron's asynchronous input-gradient all-reduce); with ``tp_overlap`` the forward
  ones beside the forward GEMMs too. Only what outlasts those GEMMs is exposed.
- pipeline sends, forward and backward, at each of the ``v`` chunks' boundaries (with tensor
  parallelism each rank sends its 1/t slice, Narayanan et al. 2021, section 4.1).

A pipeline of p stages, m micro-batches and v chunks a rank takes (m + (p-1)/v) times its
slowest stage's micro-batch (the bubble of Narayanan et al. 2021, section 2.2).

Data parallelism: ZeRO-0 all-reduces the gradients once a step, ZeRO-1/2 reduce-scatter them
and all-gather the updated parameters; with ``dp_overlap`` the reduction hides behind the
backward pass of the step's last micro-batch and the gather behind the next step's first
forward, otherwise both follow the pipeline's flush. ZeRO-3 (FSDP) gathers the parameters for
every forward and backward and reduce-scatters the gradients of every micro-batch, prefetched
behind that micro-batch's computation; one layer's gather is never hidden. Adam then updates
the rank's parameters (its shard under ZeRO), streaming its state through HBM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from distml.layout import Layout
from distml.plan import kernels
from distml.plan.collectives import Group, collective_s, group, p2p_s
from distml.plan.devices import Chip, Network
from distml.plan.spec import BYTES, ModelSpec, Training, stage_params


@dataclass
class GpuStep:
    compute_s: float  # the busiest stage's kernels over the step
    comm_s: float  # every collective and send, hidden or not
    exposed_s: float  # the part of comm_s on the critical path
    bubble_s: float
    optimizer_s: float
    step_s: float
    breakdown: dict[str, float] = field(default_factory=dict)
    assumptions: dict[str, str] = field(default_factory=dict)
    traffic: dict[str, float] = field(default_factory=dict)  # bytes a device sends, by kind


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch on the busiest (last) pipeline stage."""

    compute_s: float
    forward_s: float  # the stage's layers forward: what a parameter gather hides behind
    backward_s: float  # and backward (with recomputation): what a gradient reduction hides behind
    tp_s: float  # tensor-parallel collectives, hidden or not
    exposed_s: float  # tensor-parallel collectives and pipeline sends on the critical path
    parts: dict[str, float]

    @property
    def total_s(self) -> float:
        return self.compute_s + self.exposed_s


def tp_exchange_s(net: Network, nbytes: float, grp: Group, sequence_parallel: bool) -> float:
    """One tensor-parallel exchange of a layer's activation: an all-reduce, or with sequence
    parallelism an all-gather and a reduce-scatter (the same bytes, Korthikanti et al. 2022)."""
    if sequence_parallel:
        return collective_s(net, "all_gather", nbytes, grp) + collective_s(
            net, "reduce_scatter", nbytes, grp
        )
    return collective_s(net, "all_reduce", nbytes, grp)


def micro_batch(
    chip: Chip, net: Network, model: ModelSpec, training: Training, layout: Layout, m: int
) -> MicroBatch:
    t, p = layout.tp, layout.pp
    v = layout.chunks if layout.schedule == "interleaved" else 1
    e = BYTES[training.precision]
    layers = model.layers / p
    lt = kernels.layer_time(chip, model, training, t)
    act = e * model.seq * training.micro_batch * model.hidden  # one micro-batch's activations

    tp_group = group(layout, "tp", net.gpus_per_node)
    exchange = 2 * tp_exchange_s(net, act, tp_group, training.sequence_parallel)
    # With sequence parallelism the backward gathers each column-parallel input again (for
    # its weight gradient): three collectives a sub-layer to the forward's two.
    backward = exchange * (1.5 if training.sequence_parallel and layout.tp > 1 else 1.0)
    full = training.recompute == "full"
    # Overlapping the forward collectives (userbuffers, symmetric memory) needs NVLink peers.
    overlap = training.tp_overlap and tp_group.nodes == 1
    forward_exposed = max(0.0, exchange - lt.forward_gemm_s) if overlap else exchange
    backward_exposed = max(0.0, backward - lt.wgrad_s)
    tp_s = layers * (exchange * (2 if full else 1) + backward)
    tp_backward_exposed = backward_exposed + (forward_exposed if full else 0.0)
    tp_exposed = layers * (forward_exposed + tp_backward_exposed)

    inside = layout.world_size // p < net.gpus_per_node  # neighbouring stages share a node
    p2p = 2 * v * p2p_s(net, act / t, inside) if p > 1 else 0.0
    head = kernels.head_s(chip, model, training, t)
    accumulate = 0.0
    if m > 1 and not training.fused_grad_accumulation and layout.zero < 3:
        accumulate = kernels.accumulate_s(chip, max_stage_params(model, layout))
    layer_s = lt.forward_s + lt.backward_s + lt.recompute_s
    parts = {
        "layer_forward_s": lt.forward_s,
        "layer_backward_s": lt.backward_s,
        "layer_recompute_s": lt.recompute_s,
        "attention_s": lt.attention_s,
        "head_s": head,
        "grad_accumulation_s": accumulate,
        "tp_s": tp_s,
        "tp_exposed_s": tp_exposed,
        "layer_tp_forward_exposed_s": forward_exposed,
        "layer_tp_backward_exposed_s": tp_backward_exposed,
        "p2p_s": p2p,
    }
    return MicroBatch(
        compute_s=layers * layer_s + head + accumulate,
        forward_s=layers * lt.forward_s,
        backward_s=layers * (lt.backward_s + lt.recompute_s),
        tp_s=tp_s,
        exposed_s=tp_exposed + p2p,
        parts=parts,
    )


def max_stage_params(model: ModelSpec, layout: Layout) -> float:
    return max(stage_params(model, layout, i) for i in range(layout.pp))


def data_parallel_s(
    net: Network, model: ModelSpec, training: Training, layout: Layout, m: int, mb: MicroBatch
) -> tuple[float, float]:
    """(all data-parallel traffic of a step, the part of it exposed)."""
    d, zero = layout.data_parallel, layout.zero
    if d == 1:
        return 0.0, 0.0
    e = BYTES[training.precision]
    local = max_stage_params(model, layout)
    grads = (4 if training.grad_reduce_fp32 else e) * local
    params = e * local
    grp = group(layout, "data", net.gpus_per_node)
    if zero == 3:  # gather for forward and for backward, reduce-scatter, every micro-batch
        per_mb = 2 * collective_s(net, "all_gather", params, grp)
        per_mb += collective_s(net, "reduce_scatter", grads, grp)
        first_layer = per_mb / max(model.layers / layout.pp, 1)
        return m * per_mb, m * max(0.0, per_mb - mb.compute_s) + first_layer
    reduce = collective_s(net, "all_reduce" if zero == 0 else "reduce_scatter", grads, grp)
    gather = collective_s(net, "all_gather", params, grp) if zero else 0.0
    if not training.dp_overlap:
        return reduce + gather, reduce + gather
    return reduce + gather, max(0.0, reduce - mb.backward_s) + max(0.0, gather - mb.forward_s)


def gpu_step(
    chip: Chip, net: Network, model: ModelSpec, training: Training, layout: Layout, m: int
) -> GpuStep:
    """The time of one step of ``layout`` with ``m`` micro-batches per replica."""
    p = layout.pp
    v = layout.chunks if layout.schedule == "interleaved" else 1
    mb = micro_batch(chip, net, model, training, layout, m)
    bubble = (p - 1) / v * mb.total_s
    dp_comm, dp_exposed = data_parallel_s(net, model, training, layout, m, mb)
    local = max_stage_params(model, layout)
    opt = kernels.optimizer_s(chip, local / (layout.data_parallel if layout.zero else 1))
    step = m * mb.total_s + bubble + dp_exposed + opt
    p2p = mb.parts["p2p_s"]
    breakdown = {
        **mb.parts,
        "microbatch_s": mb.total_s,
        "bubble_s": bubble,
        "dp_comm_s": dp_comm,
        "dp_exposed_s": dp_exposed,
        "optimizer_s": opt,
    }
    return GpuStep(
        traffic=traffic(model, training, layout, m),
        compute_s=m * mb.compute_s,
        comm_s=m * (mb.tp_s + p2p) + dp_comm,
        exposed_s=m * mb.exposed_s + dp_exposed,
        bubble_s=bubble,
        optimizer_s=opt,
        step_s=step,
        breakdown=breakdown,
        assumptions=assumptions(chip, net, model, training, layout),
    )


def traffic(model: ModelSpec, training: Training, layout: Layout, m: int) -> dict[str, float]:
    """Bytes each device sends in a step, by kind, as the rings and sends above move them."""
    t, p, d, zero = layout.tp, layout.pp, layout.data_parallel, layout.zero
    v = layout.chunks if layout.schedule == "interleaved" else 1
    e = BYTES[training.precision]
    act = e * model.seq * training.micro_batch * model.hidden
    # all-reduces (or their reduce-scatter and all-gather) a layer and micro-batch: two forward,
    # two backward (three with sequence parallelism), two more forward when recomputing
    exchanges = (
        2 + (3 if training.sequence_parallel else 2) + (2 if training.recompute == "full" else 0)
    )
    local = max_stage_params(model, layout)
    grads = (4 if training.grad_reduce_fp32 else e) * local
    share = (d - 1) / d
    out = {
        "tp_all_reduce": model.layers / p * m * exchanges * 2 * (t - 1) / t * act,
        "pp_send_recv": 2 * v * m * act / t if p > 1 else 0.0,
    }
    if zero == 0:
        out["dp_all_reduce"] = 2 * share * grads
    elif zero < 3:
        out["dp_reduce_scatter"] = share * grads
        out["dp_all_gather"] = share * e * local
    else:
        out["dp_reduce_scatter"] = m * share * grads
        out["dp_all_gather"] = m * 2 * share * e * local
    return {k: b for k, b in out.items() if b}


def assumptions(
    chip: Chip, net: Network, model: ModelSpec, training: Training, layout: Layout
) -> dict[str, str]:
    """What a prediction assumed, in words: for its notes and ``--json``."""
    tp_group = group(layout, "tp", net.gpus_per_node)
    data = group(layout, "data", net.gpus_per_node)
    if model.fused_attention:
        attention = (
            f"fused (FlashAttention) at {chip.flash_attention_flops / 1e12:.0f} TFLOP/s "
            "on the causal half of the scores"
        )
    else:
        attention = "unfused: batched GEMMs over the whole s x s scores, softmax through HBM"
    if training.tp_overlap and tp_group.nodes == 1:
        tp = "hidden behind the GEMMs where these last longer"
    else:
        tp = "on the critical path forward, behind the weight-gradient GEMMs backward"
    if layout.zero == 3:
        dp = "FSDP gathers and reduce-scatters prefetched behind each micro-batch"
    elif training.dp_overlap:
        dp = "reduced during the last micro-batch's backward, gathered during the first forward"
    else:
        dp = "reduced after the pipeline flushes"
    return {
        "device": (
            f"{chip.name}: {chip.peak(training.precision) / 1e12:.0f} TFLOP/s peak; GEMMs at up "
            f"to {chip.mamf:.0%} of it by tile and wave, sustained at {chip.sustained:.0%}; "
            f"memory-bound kernels at {chip.hbm_achievable / 1e12:.2f} TB/s"
        ),
        "attention": attention,
        "network": (
            f"{net.name}: {net.gpus_per_node} GPUs a node, NCCL {net.nvlink_busbw / 1e9:.0f} "
            f"GB/s inside it, {net.nic_bw * 8 / 1e9:.0f} Gb/s a GPU between nodes at "
            f"{net.nic_efficiency:.0%}"
        ),
        "placement": (
            f"tp={layout.tp} {'inside a node' if tp_group.nodes == 1 else 'across nodes'}; "
            f"data-parallel groups of {data.size} over {data.nodes} node(s), "
            f"{data.per_node} a node"
        ),
        "overlap": (
            f"tensor-parallel collectives {tp}; pipeline sends on the critical path; "
            f"data-parallel gradients {dp}"
        ),
    }
