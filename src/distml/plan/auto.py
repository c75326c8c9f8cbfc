"""``distml run --strategy auto``: the cost model picks the layout of the world about to start.

The planner and the run share one :class:`~distml.layout.Layout`; the search offers only the
ZeRO stages a distml mesh runs (no ZeRO-1).

>>> choice = choose_layout(GPTConfig(), cluster, global_batch=16, microbatches=8)  # doctest: +SKIP
>>> choice.mesh, choice.parallel                                                  # doctest: +SKIP
({'dp': 2}, {})
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from distml.config import ConfigError, GPTConfig
from distml.layout import RUNNABLE_ZERO, Layout
from distml.plan.cost_model import Cluster, ModelSpec, Prediction, Training, predict
from distml.plan.search import divisors
from distml.telemetry.units import format_bytes


def gpt_params(cfg: GPTConfig) -> int:
    """The exact parameter count of ``distml.models.GPT(cfg)``, built on the meta device (no
    memory, whatever its size)."""
    import torch  # here: `distml plan` and the cost model run without torch

    from distml.models import GPT

    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg).parameters())


def model_spec(cfg: GPTConfig, n_params: float | None = None) -> ModelSpec:
    """How :class:`distml.models.GPT` stands for the cost model: no dropout, attention through
    torch's fused kernel, embeddings and head whole on every tensor rank, the head untied."""
    return ModelSpec(
        cfg.layers,
        cfg.hidden,
        cfg.heads,
        cfg.seq_len,
        cfg.vocab_size,
        n_params,
        dropout=False,
        fused_attention=True,
        vocab_parallel=False,
        embedding_params=(cfg.vocab_size + cfg.seq_len) * cfg.hidden,
    )


def training_for(
    layout: Layout,
    global_batch: int,
    microbatches: int,
    precision: str = "fp32",
    recompute: str = "none",
) -> Training:
    """Settings of one step under ``layout``, with AdamW: a pipeline splits each replica's
    batch into ``microbatches``, any other layout computes it whole."""
    per_replica = global_batch // layout.data_parallel
    micro = per_replica // microbatches if layout.pp > 1 else per_replica
    return Training(global_batch, max(micro, 1), precision, "adam", recompute)


def distml_layouts(
    cfg: GPTConfig,
    devices: int,
    global_batch: int,
    microbatches: int,
    schedule: str = "1f1b",
    chunks: int = 1,
) -> Iterator[Layout]:
    """Every layout of ``devices`` workers a distml mesh can run this GPT and batch under:
    dp x tp x pp = devices, tp dividing the heads, pp at most the layers, a batch that splits
    into the replicas (and, under a pipeline, into ``microbatches``), ZeRO 0, 2 or 3."""
    for tp in divisors(devices):
        for pp in divisors(devices // tp):
            dp = devices // (tp * pp)
            if cfg.heads % tp or pp > cfg.layers or global_batch % dp:
                continue
            if pp > 1 and (global_batch // dp) % microbatches:
                continue
            for zero in RUNNABLE_ZERO if dp > 1 else (0,):
                yield Layout.sharded(dp, zero, tp=tp, pp=pp, schedule=schedule, chunks=chunks)


def profile_shapes(
    cfg: GPTConfig, devices: int, global_batch: int, microbatches: int
) -> set[tuple[int, int]]:
    """The (micro-batch, tensor degree) pairs the layouts of :func:`distml_layouts` compute
    blocks at: what ``distml bench`` profiles for this model."""
    return {
        (training_for(layout, global_batch, microbatches).micro_batch, layout.tp)
        for layout in distml_layouts(cfg, devices, global_batch, microbatches)
    }


def sharded_profile_shapes(
    cfg: GPTConfig, devices: int, global_batch: int, microbatches: int
) -> set[tuple[int, int, int, int, int]]:
    """The (micro-batch, tensor degree, data degree, ZeRO stage, blocks a stage) of the FSDP
    stages those layouts run: with more than one data-parallel rank, ZeRO 2 and 3, and ZeRO-0
    under model parallelism (replicated FSDP units; DDP without)."""
    return {
        (
            training_for(lay, global_batch, microbatches).micro_batch,
            lay.tp,
            lay.data_parallel,
            lay.zero,
            round(cfg.layers / lay.pp),
        )
        for lay in distml_layouts(cfg, devices, global_batch, microbatches)
        if lay.data_parallel > 1 and (lay.zero or lay.model_parallel)
    }


@dataclass
class Choice:
    mesh: dict[str, int]
    parallel: dict[str, Any]
    prediction: Prediction
    ranked: list[Prediction] = field(default_factory=list)  # every layout that fits, best first
    too_big: list[Prediction] = field(default_factory=list)


def choose_layout(
    cfg: GPTConfig,
    cluster: Cluster,
    *,
    global_batch: int,
    microbatches: int,
    precision: str = "fp32",
    n_params: float | None = None,
    schedule: str = "1f1b",
    chunks: int = 1,
    recompute: str = "none",
) -> Choice:
    """The fastest predicted layout of ``cluster.devices`` workers that fits in device memory,
    under the run's own pipeline ``schedule`` (``chunks`` stages a rank) and ``recompute``.
    Candidates: dp x tp x pp = devices, tp dividing the heads, pp at most the layers, a batch
    that splits into the replicas (and, under a pipeline, into ``microbatches``)."""
    model = model_spec(cfg, n_params)
    n = cluster.devices
    preds = []
    for layout in distml_layouts(cfg, n, global_batch, microbatches, schedule, chunks):
        training = training_for(layout, global_batch, microbatches, precision, recompute)
        preds.append(predict(model, cluster, training, layout))
    fits = [p for p in preds if p.memory_bytes["total"] <= cluster.device.memory_bytes]
    too_big = [p for p in preds if p not in fits]
    if not preds:
        raise ConfigError(
            f"no layout of {n} workers suits {cfg.heads} heads, {cfg.layers} layers and a "
            f"global batch of {global_batch} in {microbatches} micro-batches"
        )
    if not fits:
        smallest = min(p.memory_bytes["total"] for p in preds)
        memory = format_bytes(cluster.device.memory_bytes)
        raise ConfigError(
            f"no layout of {n} workers fits this model in {memory} per device; the smallest "
            f"needs {format_bytes(smallest)}"
        )
    fits.sort(key=lambda p: p.step_time_s)
    best = fits[0].layout
    return Choice(best.mesh_sizes(), best.parallel_settings(), fits[0], fits, too_big)


def plan_record(pred: Prediction, microbatches: int) -> dict[str, Any]:
    """What a run chosen by the planner keeps of the choice (in its config, so every worker
    has it): the layout, and the prediction its summary sets beside the measurement."""
    return {
        "mesh": pred.layout.mesh_sizes(),
        "parallel": pred.layout.parallel_settings(),
        "layout": pred.layout.record(),
        "microbatches": microbatches,
        "predicted": {
            "step_time_s": pred.step_time_s,
            "compute_s": pred.compute_s,
            "comm_exposed_s": pred.comm_exposed_s,
            "bubble_fraction": pred.bubble_fraction,
            "memory_bytes": pred.memory_bytes,
        },
        "notes": pred.notes,
    }
