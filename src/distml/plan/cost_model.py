"""An analytic cost model of one training step of a GPT-style transformer under a layout.

Formulas, each from where it is published:

- Model state (ZeRO, Rajbhandari et al. 2020, section 3.1): mixed-precision Adam keeps 2 bytes of
  fp16/bf16 parameters, 2 of gradients and K = 12 of optimizer state (fp32 master copy, momentum,
  variance) per parameter. ZeRO stage 1 partitions the optimizer state over the data-parallel
  degree, stage 2 the gradients too, stage 3 the parameters too.
- Activations per layer and micro-batch (Korthikanti et al. 2022, sections 4.1-4.3):
  ``s*b*h*(10 + 24/t + 5*a*s/(h*t))`` bytes with tensor parallelism t; with sequence parallelism
  ``s*b*h*(34 + 5*a*s/h)/t``; with selective recomputation the ``5as/h`` attention term goes; with
  full recomputation only the layer input ``2*s*b*h`` (divided by t with sequence parallelism).
  Those counts are 16 tensors of ``s*b*h`` 16-bit values, two 1-byte dropout masks and the
  ``s x s`` scores; :func:`activation_bytes_per_layer` keeps the tensors apart, so that fp32
  activations, a model without dropout and a fused attention kernel (which keeps its output and
  the rows' log-sum-exp instead of the scores, Dao et al. 2022) change only their own terms.
  Stage i of a 1F1B pipeline keeps ``p - i`` micro-batches in flight, GPipe all ``m``; the first
  stage also keeps the input embeddings' dropout mask, the last the final norm, the output
  layer's input and the fp32 logits of the loss (section 4.3).
- FLOPs per step (Narayanan et al. 2021, section 5.1): ``72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h))``
  without recomputation, ``96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h))`` with full recomputation.
- Pipeline bubble (Narayanan et al. 2021, section 2.2): ``(p-1)/m`` of the ideal time for GPipe and
  1F1B, ``(p-1)/(v*m)`` for the interleaved schedule with v chunks per device.
- Ring collectives (Patarasuk and Yuan 2009): an all-reduce of n bytes over d ranks sends
  ``2*(d-1)/d*n`` from each rank, an all-gather or reduce-scatter ``(d-1)/d*n``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from distml.layout import Layout
from distml.plan.calibration import Calibration
from distml.plan.devices import CHIPS, DEFAULT_NETWORK, NETWORKS, Chip, Network
from distml.plan.gpu_step import gpu_step
from distml.plan.simulator import pipeline_step_s
from distml.plan.spec import BYTES, ModelSpec, Training, bubble_fraction, stage_params


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes: float
    peak_flops: float  # dense bf16/fp16 tensor FLOP/s, as published by the vendor
    intra_bw: float  # bytes/s per device within a node (one direction)
    inter_bw: float  # bytes/s per device between nodes (one direction)
    latency_s: float
    power_w: float
    # A named GPU's kernel-level model (:mod:`distml.plan.devices`); None for a device that
    # ``distml bench`` measured, whose step the formulas (or its calibration) give.
    chip: Chip | None = None
    # Between nodes as ``distml bench`` measured them, by size, (bytes, bytes/s) pairs:
    # all-gathers (each rank's shard; bytes/s each rank sends), and two nodes sending each
    # other messages at once (each way's bytes/s). Empty: at ``inter_bw``, both ways at once.
    inter_allgather_bw: tuple[tuple[float, float], ...] = ()
    inter_exchange_bw: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        for name in ("inter_allgather_bw", "inter_exchange_bw"):
            points = getattr(self, name)
            sizes = [size for size, _ in points]
            if any(v <= 0 for pair in points for v in pair) or sizes != sorted(set(sizes)):
                raise ValueError(f"{name}: (bytes, bytes/s) pairs, positive, by growing size")

    @property
    def gloo(self) -> bool:
        """CPU workers, whose collectives run on gloo (``distml bench`` names a CPU "cpu")."""
        return self.name == "cpu"

    def allgather_bw(self, shard_bytes: float) -> float:
        """Bytes/s each rank sends in all-gathers of ``shard_bytes`` a rank between nodes."""
        return _at_size(self.inter_allgather_bw, shard_bytes, self.inter_bw)

    def exchange_bw(self, message_bytes: float) -> float:
        """Bytes/s each way while two nodes send each other ``message_bytes`` at once."""
        return _at_size(self.inter_exchange_bw, message_bytes, self.inter_bw)


def _at_size(points: tuple[tuple[float, float], ...], size: float, default: float) -> float:
    """The measured rate at ``size``: linear in the logarithm of the size between two measured
    sizes, the nearest one's outside them; ``default`` where none was measured."""
    if not points:
        return default
    if size <= points[0][0]:
        return points[0][1]
    for (s0, b0), (s1, b1) in zip(points, points[1:], strict=False):
        if size <= s1:
            return b0 + math.log(size / s0) / math.log(s1 / s0) * (b1 - b0)
    return points[-1][1]


def named_device(chip: Chip) -> Device:
    """A :class:`Device` for a published GPU, its links those of its usual node."""
    net = NETWORKS[DEFAULT_NETWORK[chip.name]]
    return Device(
        chip.name,
        chip.memory_bytes,
        chip.peak("bf16"),
        net.nvlink_bw,
        net.nic_bw,
        net.intra_latency_s,
        chip.power_w,
        chip,
    )


DEVICES: dict[str, Device] = {name: named_device(chip) for name, chip in CHIPS.items()}


@dataclass(frozen=True)
class Cluster:
    device: Device
    devices: int
    devices_per_node: int = 8
    # Measured pieces of one model's step on these devices (``distml bench --config ...``).
    calibration: Calibration | None = None
    # The links of a named GPU's nodes; None: the chip's usual node (a DGX of its generation).
    network: Network | None = None
    name: str = ""

    def links(self) -> Network:
        chip = self.device.chip
        net = self.network or NETWORKS[DEFAULT_NETWORK[chip.name if chip else "a100"]]
        if net.gpus_per_node != self.devices_per_node:
            net = replace(net, gpus_per_node=self.devices_per_node)
        return net


@dataclass
class Prediction:
    layout: Layout
    memory_bytes: dict[str, float]
    flops: float
    compute_s: float
    comm_bytes: dict[str, float]
    comm_s: float
    comm_exposed_s: float  # the part of comm_s not hidden behind computation
    bubble_fraction: float
    step_time_s: float
    tokens_per_s: float
    mfu: float
    energy_j: float
    notes: list[str] = field(default_factory=list)
    # What a named GPU's prediction assumed (efficiencies, overlap, placement), and its parts.
    assumptions: dict[str, str] = field(default_factory=dict)
    breakdown: dict[str, float] = field(default_factory=dict)


def optimizer_bytes_per_param(training: Training) -> float:
    """ZeRO's K: fp32 master weights + two Adam moments = 12; SGD with momentum keeps 8 (master
    copy and momentum) in mixed precision, 4 in fp32."""
    mixed = training.precision != "fp32"
    if training.optimizer == "adam":
        return 12.0 if mixed else 8.0
    return 8.0 if mixed else 4.0


def model_state_bytes(n_params: float, layout: Layout, training: Training) -> dict[str, float]:
    """Parameters, gradients and optimizer state held by one device (ZeRO section 3.1), with
    the model split evenly over tensor and pipeline ranks."""
    return _state_bytes(n_params / (layout.tp * layout.pp), layout, training)


def _state_bytes(local: float, layout: Layout, training: Training) -> dict[str, float]:
    p = BYTES[training.precision]
    d = layout.data_parallel
    k = optimizer_bytes_per_param(training)
    return {
        "params": p * local / (d if layout.zero >= 3 else 1),
        "grads": p * local / (d if layout.zero >= 2 else 1),
        "optimizer": k * local / (d if layout.zero >= 1 else 1),
    }


def activation_bytes_per_layer(model: ModelSpec, training: Training, tp: int) -> float:
    """One transformer layer's stored activations for one micro-batch (Korthikanti et al.,
    section 4.1, term by term).

    Per ``s*b*h`` values: the two norms' inputs and outputs (4 tensors, repeated on every
    tensor rank unless sequence parallelism splits them); q, k, v, the attention output and the
    MLP's input and output of GeLU (1 + 1 + 1 + 1 + 4 + 4 = 12, split over tensor ranks; a
    fused kernel's output is the attention output, the output projection's input; fewer
    key/value heads shrink k and v, a gated MLP keeps three ffn-wide tensors); one byte of
    dropout mask after attention and after the MLP. Per ``a*s*s*b`` (unfused only): the softmax
    output, its dropout mask and output.
    """
    s, b, h, a, t = model.seq, training.micro_batch, model.hidden, model.heads, tp
    e = BYTES[training.precision]
    sp = training.sequence_parallel
    if training.recompute == "full":
        return e * s * b * h / (t if sp else 1)
    masks = 2 if model.dropout else 0
    replicated = 4 * e + masks
    # q, k, v, the attention output; the MLP's activation input and output (GeLU: 4h each;
    # a gated MLP keeps its two projections and their product)
    h = model.hidden
    attention_values = 2 + 2 * model.kv_hidden / h
    mlp_values = (3 if model.gated_mlp else 2) * model.ffn / h
    split = (attention_values + mlp_values) * e
    per_token = (replicated + split) / t if sp else replicated + split / t
    if model.fused_attention:  # the kernel keeps the rows' fp32 log-sum-exp, not the scores
        attention = 4 * a * s * b / t
    elif training.recompute == "selective":
        attention = 0.0
    else:
        attention = (2 * e + (1 if model.dropout else 0)) * a * s * s * b / t
    return s * b * h * per_token + attention


def edge_activation_bytes(model: ModelSpec, training: Training, tp: int, stage: str) -> float:
    """The activations outside the blocks for one micro-batch (Korthikanti et al., section
    4.3): on the ``"first"`` stage the embeddings' dropout mask; on the ``"last"`` the final
    norm's input, the output layer's input and the loss's fp32 logits."""
    s, b, h, v = model.seq, training.micro_batch, model.hidden, model.vocab
    e = BYTES[training.precision]
    if stage == "first":
        return s * b * h / tp if model.dropout else 0.0
    logits = 4 * s * b * v / (tp if model.vocab_parallel else 1)
    return 2 * e * s * b * h / (tp if training.sequence_parallel else 1) + logits


def activation_bytes(model: ModelSpec, training: Training, layout: Layout, m: int) -> float:
    """The largest stage's activation peak: stage i keeps ``p - i`` micro-batches in flight
    under 1F1B (at most m), all m under GPipe; one stage's 1F1B schedule is the pipeline's
    first stage with p in flight."""
    per_layer = activation_bytes_per_layer(model, training, layout.tp)
    layers_here = model.layers / layout.pp
    peaks = []
    for i in range(layout.pp):
        in_flight = m if layout.schedule == "gpipe" else min(m, layout.pp - i)
        edges = 0.0
        if i == 0:
            edges += edge_activation_bytes(model, training, layout.tp, "first") * in_flight
        if i == layout.pp - 1:
            edges += edge_activation_bytes(model, training, layout.tp, "last") * in_flight
        peaks.append(per_layer * layers_here * in_flight + edges)
    return max(peaks)


def training_flops(model: ModelSpec, batch: int, recompute: str) -> float:
    """FLOPs of one step over ``batch`` sequences (Narayanan et al. 2021, eq. 3): the blocks'
    matrices and the full s x s attention, three passes (four with full recomputation), and
    the output layer's three. For the GPT that is ``72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h))``,
    or ``96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h))`` recomputing; other shapes (a wider or gated
    MLP, fewer key/value heads) count their own matrices."""
    s, h = model.seq, model.hidden
    layer = 2 * model.layer_weights + 4 * s * h  # forward FLOPs a token
    passes = 4 if recompute == "full" else 3
    return batch * s * (passes * model.layers * layer + 3 * 2 * h * model.vocab)


def ring(collective: str, nbytes: float, ranks: int) -> float:
    if ranks <= 1:
        return 0.0
    factor = 2 * (ranks - 1) / ranks if collective == "all_reduce" else (ranks - 1) / ranks
    return factor * nbytes


def _formula_traffic(
    model: ModelSpec, training: Training, layout: Layout, m: int
) -> dict[str, float]:
    """Bytes each device sends in a step, by collective, as the formulas count them."""
    p_bytes = BYTES[training.precision]
    d = layout.data_parallel
    local_params = max(stage_params(model, layout, i) for i in range(layout.pp))
    grad_bytes = p_bytes * local_params
    dp_collective = {0: "all_reduce", 1: "all_reduce", 2: "reduce_scatter", 3: "reduce_scatter"}
    comm = {f"dp_{dp_collective[layout.zero]}": ring(dp_collective[layout.zero], grad_bytes, d)}
    if layout.zero >= 1:
        comm["dp_all_gather"] = ring("all_gather", grad_bytes, d) * (2 if layout.zero == 3 else 1)
    act = p_bytes * training.micro_batch * model.seq * model.hidden
    # Megatron TP: 2 all-reduces forward and 2 backward per layer and micro-batch.
    comm["tp_all_reduce"] = 4 * model.layers / layout.pp * m * ring("all_reduce", act, layout.tp)
    comm["pp_send_recv"] = 2 * m * act if layout.pp > 1 else 0.0
    return {k: v for k, v in comm.items() if v}


def predict(model: ModelSpec, cluster: Cluster, training: Training, layout: Layout) -> Prediction:
    """Memory, time, traffic and energy of one optimizer step under ``layout``."""
    d = layout.data_parallel
    if layout.world_size != cluster.devices:
        raise ValueError(
            f"dp x tp x pp = {d} x {layout.tp} x {layout.pp} = {layout.world_size}, "
            f"but the cluster has {cluster.devices} devices"
        )
    if layout.dp > 1 and layout.fsdp > 1:
        raise ValueError(f"the cost model has no layout that shards and replicates ({layout})")
    per_replica = training.global_batch // d
    if per_replica * d != training.global_batch or per_replica % training.micro_batch:
        raise ValueError(
            f"global batch {training.global_batch} does not split into dp={d} replicas "
            f"of micro-batches of {training.micro_batch}"
        )
    m = per_replica // training.micro_batch
    device = cluster.device

    states = [
        _state_bytes(stage_params(model, layout, i), layout, training) for i in range(layout.pp)
    ]
    memory = max(states, key=lambda state: sum(state.values()))
    memory["activations"] = activation_bytes(model, training, layout, m)
    memory["total"] = sum(memory.values())

    flops = training_flops(model, training.global_batch, training.recompute)
    notes: list[str] = []
    assumptions: dict[str, str] = {}
    breakdown: dict[str, float] = {}
    if device.chip is not None:  # a published GPU: kernels by shape, collectives by link
        gpu = gpu_step(device.chip, cluster.links(), model, training, layout, m)
        compute_s, comm_s, exposed_s, step = gpu.compute_s, gpu.comm_s, gpu.exposed_s, gpu.step_s
        comm = gpu.traffic
        bubble = gpu.bubble_s / step
        peak = device.chip.peak(training.precision)
        assumptions, breakdown = gpu.assumptions, gpu.breakdown
    else:
        peak = device.peak_flops
        compute_s = flops / cluster.devices / peak
        bubble = bubble_fraction(layout, m)
        comm = _formula_traffic(model, training, layout, m)
        tp_inside_node = layout.tp <= cluster.devices_per_node
        tp_bw = device.intra_bw if tp_inside_node else device.inter_bw
        one_node = layout.world_size <= cluster.devices_per_node
        dp_bw = device.intra_bw if one_node else device.inter_bw
        # TP all-reduces and pipeline sends sit on the critical path. Data-parallel gradient
        # traffic is bucketed and overlaps the backward pass (2 of the 3 passes, 3 of 4 with
        # recomputation); only what outlasts it is exposed. Not on CPU workers: gloo reduces
        # and copies on the cores the backward pass computes on, and benchmarks/network.py
        # finds most of DDP's all-reduce time in the step there (BENCHMARKS.md, slow links).
        critical_s = comm.get("tp_all_reduce", 0.0) / tp_bw + comm.get("pp_send_recv", 0.0) / dp_bw
        # FSDP gathers a block a collective, and between nodes an all-gather of that size moves
        # at the rate distml bench measured for it.
        shard = BYTES[training.precision] * model.layer_weights / layout.tp / d
        gather_bw = dp_bw if one_node else device.allgather_bw(shard)
        dp_s = (
            comm.get("dp_all_gather", 0.0) / gather_bw
            + sum(v for k, v in comm.items() if k.startswith("dp_") and k != "dp_all_gather")
            / dp_bw
        )
        overlap = training.dp_overlap and not device.gloo
        backward_s = compute_s * (0.75 if training.recompute == "full" else 2 / 3) * overlap
        dp_exposed_s = max(0.0, dp_s - backward_s)
        comm_s = critical_s + dp_s
        exposed_s = critical_s + dp_exposed_s
        step = (compute_s + exposed_s) / (1 - bubble)
        if (
            layout.pp > 1
            and layout.schedule == "1f1b"
            and not one_node
            and device.inter_exchange_bw
        ):
            # Stages on other nodes, whose link distml bench measured both ways at once:
            # torch's 1F1B with its transfers, which overlap where the link carries both ways.
            micro_s = (compute_s + comm.get("tp_all_reduce", 0.0) / tp_bw) / m
            message = comm["pp_send_recv"] / (2 * m)
            pipeline_s = pipeline_step_s(layout.pp, m, micro_s / 3, 2 * micro_s / 3, message,
                                         device.inter_bw, device.exchange_bw(message))  # fmt: skip
            step = pipeline_s + dp_exposed_s / (1 - bubble)
            exposed_s = step * (1 - bubble) - compute_s
    calibration = cluster.calibration
    if calibration is not None and calibration.describes(model, training, cluster.devices):
        measured = calibration.step(model, training, layout, m)
        if measured is None:
            notes.append("not calibrated at this micro-batch or group size: formulas")
        else:
            compute_s, comm_s, exposed_s = measured.compute_s, measured.comm_s, measured.exposed_s
            step = measured.step_s
            bubble = 1 - (compute_s + exposed_s) / step
            notes.append("step time from the calibration")
    tokens = training.global_batch * model.seq
    model_flops = training_flops(model, training.global_batch, "none")
    if memory["total"] > device.memory_bytes:
        notes.append(f"needs {memory['total'] / 1e9:.1f} GB of {device.memory_bytes / 1e9:.0f} GB")
    return Prediction(
        layout=layout,
        memory_bytes=memory,
        flops=flops,
        compute_s=compute_s,
        comm_bytes=comm,
        comm_s=comm_s,
        comm_exposed_s=exposed_s,
        bubble_fraction=bubble,
        step_time_s=step,
        tokens_per_s=tokens / step,
        mfu=model_flops / (step * cluster.devices * peak),
        energy_j=step * cluster.devices * device.power_w,
        notes=notes,
        assumptions=assumptions,
        breakdown=breakdown,
    )


def days_to_train(tokens: float, params: float, devices: int, flops_per_device: float) -> float:
    """End-to-end training time with recomputation, ``8*T*P/(n*X)`` (Narayanan et al. 2021)."""
    return 8 * tokens * params / (devices * flops_per_device) / 86400
