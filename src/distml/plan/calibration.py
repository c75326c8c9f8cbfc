"""A step's time from measured pieces (:mod:`distml.plan.profile`), for the one model they were
measured on.

Per pipeline stage (the slowest sets the step):

- compute: ``layers/p x m`` blocks' forward + backward at the micro-batch and tensor degree (with
  full recomputation one forward more), the embeddings on the first stage and the head on the
  last, once per micro-batch, and AdamW over the parameters the rank updates (its shard under
  ZeRO);
- data-parallel work: under FSDP the stage's blocks as profiled (their collectives, FSDP's
  copies and the AdamW step over DTensor shards), synchronising the gradients on the last
  micro-batch only. The rest from the collectives' fits, each call with its latency: one
  all-reduce of the gradients per DDP bucket (25 MiB) or per FSDP unit; the root unit's
  all-gathers (ZeRO-3: before forward and backward; ZeRO-2: once) and reduce-scatter;
- pipeline sends: each micro-batch's activations forward and their gradients back.

Collectives are exposed when workers share cores (they run on the same ones); otherwise the
data-parallel ones hide behind the backward pass until they outlast it, as in the formulas. A
pipeline's step is the stage's work stretched by the bubble, ``T / (1 - bubble)``, unless
workers share cores: then an idle stage lends its share to the others, and the step is at least
``T`` and at most ``T / ((1 - bubble) * share)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from distml.layout import Layout
from distml.plan.spec import ModelSpec, Training, bubble_fraction, stage_params

DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket_cap_mb


@dataclass(frozen=True)
class Timing:
    compute_s: float
    comm_s: float
    exposed_s: float
    step_s: float


@dataclass(frozen=True)
class Calibration:
    model: dict[str, int]  # layers, hidden, heads, seq, vocab
    world: int
    share: float
    blocks: dict[str, dict[str, float]]  # "BxT" -> fwd_s, fwdbwd_s
    edges: dict[str, dict[str, float]]  # "B" -> embed_s, head_s
    optimizer_s_per_param: float
    collectives: dict[str, dict[str, list[float]]]  # name -> group size -> [alpha, beta]
    # "BxTxDxZxK" -> a stage of K FSDP blocks: sync_s, nosync_s (forward + backward), opt_s
    sharded_stages: dict[str, dict[str, float]] = field(default_factory=dict)
    precision: str = "fp32"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Calibration:
        try:
            return cls(
                model={k: int(v) for k, v in data["model"].items()},
                world=int(data["world"]),
                share=float(data["share"]),
                blocks={k: {n: float(s) for n, s in v.items()} for k, v in data["blocks"].items()},
                edges={k: {n: float(s) for n, s in v.items()} for k, v in data["edges"].items()},
                optimizer_s_per_param=float(data["optimizer_s_per_param"]),
                collectives={
                    name: {size: [float(a), float(b)] for size, (a, b) in fits.items()}
                    for name, fits in data["collectives"].items()
                },
                sharded_stages={
                    k: {n: float(x) for n, x in v.items()}
                    for k, v in data.get("sharded_stages", {}).items()
                },
                precision=str(data.get("precision", "fp32")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"[calibration] is malformed: {exc!r}") from None

    def describes(self, model: ModelSpec, training: Training, devices: int) -> bool:
        """Whether these measurements are of ``model`` trained as ``training`` asks, by a world
        of ``devices`` workers."""
        dims = (model.layers, model.hidden, model.heads, model.seq, model.vocab)
        mine = tuple(self.model[k] for k in ("layers", "hidden", "heads", "seq", "vocab"))
        return dims == mine and training.precision == self.precision and devices == self.world

    def collective_s(self, name: str, nbytes: float, ranks: int, calls: int = 1) -> float | None:
        """``calls`` collectives over groups of ``ranks``, ``nbytes`` of each rank's input in
        all; None where that group size was not measured."""
        if ranks <= 1 or calls == 0:
            return 0.0
        fit = self.collectives.get(name, {}).get(str(ranks))
        if fit is None:
            return None
        alpha, beta = fit
        return calls * alpha + nbytes / beta

    def step(self, model: ModelSpec, training: Training, layout: Layout, m: int) -> Timing | None:
        """The step of ``layout`` from the measurements, or None where a piece it needs (its
        micro-batch and tensor degree, a group size) was not measured."""
        stages = [self._stage(model, training, layout, m, i) for i in range(layout.pp)]
        if None in stages:
            return None
        worst = max(stages, key=lambda timing: timing.step_s)
        stretched = worst.step_s / (1 - bubble_fraction(layout, m))
        shared = self.share > 1.05
        step = max(worst.step_s, stretched / self.share) if shared else stretched
        return Timing(worst.compute_s, worst.comm_s, worst.exposed_s, step)

    def _stage(
        self, model: ModelSpec, training: Training, layout: Layout, m: int, stage: int
    ) -> Timing | None:
        """One pipeline stage's work in a step, as if it never waited for another."""
        b, t, p, d, zero = (
            training.micro_batch,
            layout.tp,
            layout.pp,
            layout.data_parallel,
            layout.zero,
        )
        block, edge = self.blocks.get(f"{b}x{t}"), self.edges.get(str(b))
        if block is None or edge is None:
            return None
        layers = model.layers / p
        params = stage_params(model, layout, stage)
        compute = m * (edge["embed_s"] if stage == 0 else 0.0)
        compute += m * (edge["head_s"] if stage == p - 1 else 0.0)
        if training.recompute == "full":
            compute += layers * m * block["fwd_s"]
        key = f"{b}x{t}x{d}x{zero}x{round(layers)}"
        sharded = self.sharded_stages.get(key) if d > 1 else None
        if sharded is None:  # plain blocks; the gradients' collectives from their fits
            compute += layers * m * block["fwdbwd_s"]
            compute += self.optimizer_s_per_param * params / (d if zero else 1)
            dp_s = self._data_parallel_s(model, layout, params, m, units=round(layers) + 1)
        else:  # the stage's FSDP blocks as profiled, the last micro-batch synchronising
            compute += (m - 1) * sharded["nosync_s"] + sharded["sync_s"] + sharded["opt_s"]
            root = params - layers * model.layer_params / t  # embeddings, head: from the fits
            compute += self.optimizer_s_per_param * root / (d if zero else 1)
            dp_s = self._data_parallel_s(model, layout, root, m, units=1)
        pp_s = self._pipeline_s(model, training, layout, m)
        if dp_s is None or pp_s is None:
            return None
        comm = dp_s + pp_s
        backward = compute * (0.75 if training.recompute == "full" else 2 / 3)
        exposed = comm if self.share > 1.05 else comm - min(dp_s, backward)
        return Timing(compute, comm, exposed, compute + exposed)

    def _data_parallel_s(
        self, model: ModelSpec, layout: Layout, params: float, m: int, units: int
    ) -> float | None:
        """Gradient synchronisation of ``params`` held in ``units`` FSDP units (or DDP's
        buckets, without model parallelism)."""
        d, zero = layout.data_parallel, layout.zero
        if d == 1:
            return 0.0
        nbytes = 4 * params
        if zero == 0:
            model_parallel = layout.tp > 1 or layout.pp > 1
            calls = units if model_parallel else math.ceil(nbytes / DDP_BUCKET_BYTES)
            return self.collective_s("all_reduce", nbytes, d, calls)
        gathers = {1: 1, 2: 1, 3: 2 * (m if layout.pp > 1 else 1)}[zero]
        gather = self.collective_s("all_gather", gathers * nbytes / d, d, gathers * units)
        scatter = self.collective_s("reduce_scatter", nbytes, d, units)
        return None if gather is None or scatter is None else gather + scatter

    def _pipeline_s(
        self, model: ModelSpec, training: Training, layout: Layout, m: int
    ) -> float | None:
        if layout.pp == 1:
            return 0.0
        act = 4 * training.micro_batch * model.seq * model.hidden
        one = self.collective_s("p2p", act, 2)
        return None if one is None else 2 * m * one
