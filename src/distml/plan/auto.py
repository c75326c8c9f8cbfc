"""``distml run --strategy auto``: the cost model picks the layout of the world about to start,
and how its replicas synchronise.

The planner and the run share one :class:`~distml.layout.Layout`; the search offers only the
ZeRO stages a distml mesh runs (no ZeRO-1). A layout of replicas alone (DDP) is weighed under
each way to synchronise them (:data:`distml.plan.sync.AUTO_SYNCS`: fp16 or PowerSGD
compression, Local SGD, DiLoCo): their step from the bytes each moves on the measured link
(and, for PowerSGD on CPU workers, what its hook's own work measures here,
:mod:`distml.plan.hook_probe`), their steps to a loss from
:data:`distml.plan.sync.STEPS_RULE`. Options rank by predicted time
to a loss, step seconds x relative steps, not by step time alone.

>>> choice = choose_layout(GPTConfig(), cluster, global_batch=16, microbatches=8)  # doctest: +SKIP
>>> choice.mesh, choice.parallel                                                  # doctest: +SKIP
({'dp': 2}, {})
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from distml.config import ConfigError, GPTConfig
from distml.layout import RUNNABLE_ZERO, Layout
from distml.plan.cost_model import Cluster, Device, ModelSpec, Prediction, Training, predict
from distml.plan.search import divisors
from distml.plan.sync import DDP, STEPS_RULE, Sync, data_parallel_step, steps_factor
from distml.telemetry.units import format_bytes


def gpt_shapes(cfg: GPTConfig) -> list[tuple[int, ...]]:
    """The parameter shapes of ``distml.models.GPT(cfg)``, built on the meta device (no
    memory, whatever its size)."""
    import torch  # here: `distml plan` and the cost model run without torch

    from distml.models import GPT

    with torch.device("meta"):
        return [tuple(p.shape) for p in GPT(cfg).parameters()]


def gpt_params(cfg: GPTConfig) -> int:
    """The exact parameter count of ``distml.models.GPT(cfg)``."""
    return sum(math.prod(shape) for shape in gpt_shapes(cfg))


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


@dataclass(frozen=True)
class Option:
    """A layout that fits, with how its replicas synchronise (DDP's own for any other layout)."""

    prediction: Prediction  # its step under ``sync``
    sync: Sync = DDP
    steps_factor: float = 1.0  # steps to a loss relative to DDP's (the stated rule)

    @property
    def layout(self) -> Layout:
        return self.prediction.layout

    @property
    def time_to_loss_s(self) -> float:
        """Predicted seconds per DDP step's worth of progress: what the options rank by."""
        return self.prediction.step_time_s * self.steps_factor

    @property
    def label(self) -> str:
        return str(self.layout) + ("" if self.sync == DDP else f" + {self.sync.label}")


@dataclass
class Choice:
    mesh: dict[str, int]
    parallel: dict[str, Any]
    prediction: Prediction
    ranked: list[Option] = field(default_factory=list)  # every option that fits, best first
    too_big: list[Prediction] = field(default_factory=list)

    @property
    def sync(self) -> Sync:
        return self.ranked[0].sync


def hook_costs(
    shapes: Sequence[Sequence[int]], syncs: Sequence[Sync], device: Device, threads: int
) -> dict[str, float]:
    """The seconds a step each PowerSGD among ``syncs`` spends on its own work on gradients of
    ``shapes``, by label, measured on this machine for CPU workers of ``threads`` threads
    (their hook's matrices and bookkeeping run on the CPU that computes; none is measured for
    GPUs, where it is small)."""
    ranks = sorted({s.rank for s in syncs if s.name == "powersgd"})
    if not ranks or not device.gloo:
        return {}
    from distml.plan.hook_probe import powersgd_hook_s

    return {f"powersgd-r{r}": s for r, s in powersgd_hook_s(shapes, ranks, threads).items()}


def is_replicas(layout: Layout) -> bool:
    """Whole replicas and nothing else: the layout a choice of synchronisation applies to."""
    return layout.data_parallel > 1 and not layout.zero and not layout.model_parallel


def sync_options(
    pred: Prediction,
    syncs: Sequence[Sync],
    shapes: Sequence[Sequence[int]],
    *,
    gloo: bool,
    latency_s: float = 0.0,
    hook_s: Mapping[str, float] | None = None,
    rule: dict[str, float] = STEPS_RULE,
) -> list[Option]:
    """``pred``, a layout of replicas under DDP, under each of ``syncs`` instead; ``hook_s``:
    the measured seconds a step of a gradient hook's own work, by label (:func:`hook_costs`),
    ``latency_s`` a collective's on the link."""
    ranks = pred.layout.data_parallel
    ddp = (pred.step_time_s, pred.comm_s, pred.comm_exposed_s)
    options = []
    for sync in syncs:
        own = (hook_s or {}).get(sync.label, 0.0)
        step, comm, exposed = data_parallel_step(
            sync, shapes, ranks, ddp, gloo=gloo, latency_s=latency_s, hook_s=own
        )
        factor = steps_factor(sync, rule)
        scale = pred.step_time_s / step
        note = [f"{sync.label}: {factor:g}x DDP's steps to a loss"] if sync != DDP else []
        if own:
            note.append(f"{sync.label}: its hook's own work, {own * 1e3:.1f} ms a step here")
        under = replace(
            pred,
            comm_s=comm,
            comm_exposed_s=exposed,
            step_time_s=step,
            tokens_per_s=pred.tokens_per_s * scale,
            mfu=pred.mfu * scale,
            energy_j=pred.energy_j / scale,
            notes=[*pred.notes, *note],
        )
        options.append(Option(under, sync, factor))
    return options


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
    syncs: Sequence[Sync] = (DDP,),
    hook_s: Mapping[str, float] | None = None,
) -> Choice:
    """The fastest predicted layout of ``cluster.devices`` workers that fits in device memory,
    under the run's own pipeline ``schedule`` (``chunks`` stages a rank) and ``recompute``.
    Candidates: dp x tp x pp = devices, tp dividing the heads, pp at most the layers, a batch
    that splits into the replicas (and, under a pipeline, into ``microbatches``); a layout of
    replicas under each of ``syncs`` (their hooks' own work a step: ``hook_s``, by label),
    ranked by predicted time to a loss."""
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
    options: list[Option] = []
    shapes = gpt_shapes(cfg) if any(sync != DDP for sync in syncs) else []
    for pred in fits:
        if is_replicas(pred.layout) and shapes:
            options += sync_options(pred, syncs, shapes, gloo=cluster.device.gloo,
                                    latency_s=cluster.device.latency_s, hook_s=hook_s)  # fmt: skip
        else:
            options.append(Option(pred))
    options.sort(key=lambda o: o.time_to_loss_s)
    best = options[0]
    return Choice(
        best.layout.mesh_sizes(), best.layout.parallel_settings(), best.prediction, options, too_big
    )


def plan_record(
    option: Option, microbatches: int, hook_s: Mapping[str, float] | None = None
) -> dict[str, Any]:
    """What a run chosen by the planner keeps of the choice (in its config, so every worker
    has it): the layout, the synchronisation, the hooks' measured work it weighed, and the
    prediction its summary sets beside the measurement."""
    pred = option.prediction
    return {
        "hook_s": dict(hook_s or {}),
        "mesh": pred.layout.mesh_sizes(),
        "parallel": pred.layout.parallel_settings(),
        "layout": pred.layout.record(),
        "sync": option.sync.label,
        "steps_factor": option.steps_factor,
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
