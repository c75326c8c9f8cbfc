"""How data-parallel replicas synchronise over a given link, and which way is fastest to a loss.

Each synchronisation strategy moves a known number of bytes a step (ring collectives, one rank
each way on every link; see :mod:`distml.comm.collectives`):

- ``ddp``: all-reduce every fp32 gradient, ``2(N-1)/N x 4 P`` bytes;
- ``ddp-fp16``: the same in fp16, half of it;
- ``powersgd-rR``: torch's PowerSGD hook: after ``start_iter`` plain steps, each gradient
  viewed as a matrix ``n x m`` travels as its factors ``(n + m) R`` when that is at most half
  of ``n m`` (``min_compression_rate`` 2), as itself otherwise (vectors included);
- ``local-sgd`` / ``diloco``: the parameters are averaged every ``H`` steps, ``1/H`` of DDP;
- ``fsdp``: ZeRO-3, two all-gathers and one reduce-scatter, ``3 (N-1)/N x 4 P``; on gloo,
  which all-reduces for a reduce-scatter, ``4 (N-1)/N x 4 P``;
- ``pipeline``: the activations at the stage boundary forward and their gradients backward,
  one after the other (the schedule waits on each transfer in turn).

A step then takes what it takes on a fast link plus what its bytes add at the slower one
(:func:`step_seconds`): the compute and the local work do not change with the link. Give it the
links' bandwidth as ``distml bench --nnodes`` measures it (a collective over a slow link moves
less than the line rate); :func:`line_rate_bytes` is the best a rate alone can say. Strategies
that change the optimisation (PowerSGD's approximation, Local SGD's drift) need more steps to a
given loss; :func:`choose` ranks them by predicted *time to the target*, steps x seconds, with
the steps from a short measured probe of each strategy's loss curve, or, where nothing was
measured (``distml run --strategy auto``), from the stated rule :data:`STEPS_RULE`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from distml.config import StrategyConfig

# TCP/IPv4 with timestamps carries 1448 payload bytes in every 1514-byte Ethernet frame: what
# a shaped link's rate counts includes the headers.
TCP_PAYLOAD_FRACTION = 1448 / 1514
FP32 = 4


def _ring(ranks: int) -> float:
    return 2 * (ranks - 1) / ranks


def powersgd_elements(
    shapes: Iterable[Sequence[int]], rank: int, min_compression_rate: float = 2.0
) -> int:
    """Elements PowerSGD all-reduces a compressed step, as torch's hook decides them."""
    total = 0
    for shape in shapes:
        n = shape[0] if shape else 1
        m = math.prod(shape[1:]) if len(shape) > 1 else 1
        r = min(n, m, rank)
        compressed = (n + m) * r
        total += compressed if compressed * min_compression_rate < n * m else n * m
    return total


@dataclass(frozen=True)
class Sync:
    """One way to synchronise: its name and its settings."""

    name: str  # ddp, ddp-fp16, powersgd, local-sgd, diloco, fsdp, pipeline
    rank: int = 2  # powersgd
    start_iter: int = 2  # powersgd: plain all-reduce before this step
    every: int = 8  # local-sgd, diloco: H

    @property
    def label(self) -> str:
        return f"powersgd-r{self.rank}" if self.name == "powersgd" else self.name

    @property
    def averages_parameters(self) -> bool:
        """Local SGD and DiLoCo: parameters averaged after a step, not gradients during it."""
        return self.name in ("local-sgd", "diloco")

    def run_settings(self) -> list[tuple[str, Any]]:
        """The run config's settings (``--set`` keys) that train under this synchronisation;
        DiLoCo with its paper's outer optimizer (Nesterov 0.9, rate 0.7)."""
        if self.name == "ddp":
            return []
        if self.name == "ddp-fp16":
            return [("strategy.compression", "fp16")]
        if self.name == "powersgd":
            return [
                ("strategy.compression", "powersgd"),
                ("strategy.powersgd_rank", self.rank),
                ("strategy.powersgd_start_iter", self.start_iter),
            ]
        if self.averages_parameters:
            local = [("strategy.name", "local-sgd"), ("strategy.sync_every", self.every)]
            if self.name == "diloco":
                local += [("strategy.outer_lr", 0.7), ("strategy.outer_momentum", 0.9)]
            return local
        raise ValueError(f"{self.label} is a layout, not a setting of a data-parallel run")


DDP = Sync("ddp")

# The stated rule: optimizer steps to a given loss, relative to DDP's, for the strategies that
# change the optimisation, by label (a PowerSGD rank not listed takes ``powersgd``'s). They are
# the loss curves benchmarks/network.py measures for the GPT (steps to DDP's loss, the larger
# of two machines' curves, rounded up to a tenth; BENCHMARKS.md, slow links): the same seed and
# arithmetic rounded differently on an Intel and an AMD CPU needed 112 and 128 steps to DDP's
# 96-step loss under PowerSGD rank 2, 104 and 112 under Local SGD. fp16 compression loses too
# (gradients that underflow in half precision). A measured probe of the run's own model says
# more; this is what the planner assumes without one.
STEPS_RULE: dict[str, float] = {
    "ddp": 1.0,
    "ddp-fp16": 1.4,
    "powersgd-r2": 1.4,
    "powersgd-r8": 1.4,
    "powersgd": 1.4,
    "local-sgd": 1.2,
    "diloco": 1.5,
}


def steps_factor(sync: Sync, rule: Mapping[str, float] = STEPS_RULE) -> float:
    """Steps to a loss relative to DDP's under ``sync``, by the rule."""
    return rule.get(sync.label, rule[sync.name])


# What ``distml run --strategy auto`` weighs for a data-parallel layout.
AUTO_SYNCS: tuple[Sync, ...] = (
    DDP,
    Sync("ddp-fp16"),
    Sync("powersgd", rank=2),
    Sync("powersgd", rank=8),
    Sync("local-sgd", every=8),
    Sync("diloco", every=8),
)


def wire_bytes_per_step(
    sync: Sync,
    shapes: Sequence[Sequence[int]],
    ranks: int,
    *,
    steps: int,
    boundary_activation_bytes: float = 0.0,
    gloo: bool = False,
) -> float:
    """Bytes a step waits for on each rank's link (the mean over ``steps`` steps): what a ring
    sends from each rank (both directions of every link busy at once), or a pipeline's
    transfers end to end.

    ``boundary_activation_bytes``: under ``pipeline``, one step's activations at the stage
    boundary (global batch x sequence x hidden x 4 for fp32); their gradients come back the
    same size. ``gloo``: the backend has no reduce-scatter and all-reduces instead."""
    params = sum(math.prod(s) for s in shapes)
    full = _ring(ranks) * FP32 * params
    if sync.name == "ddp":
        return full
    if sync.name == "ddp-fp16":
        return full / 2
    if sync.name == "powersgd":
        plain = min(sync.start_iter, steps)
        compressed = _ring(ranks) * FP32 * powersgd_elements(shapes, sync.rank)
        return (plain * full + (steps - plain) * compressed) / steps
    if sync.name in ("local-sgd", "diloco"):
        return full / sync.every
    if sync.name == "fsdp":
        return (2.0 if gloo else 1.5) * full
    if sync.name == "pipeline":
        return 2 * boundary_activation_bytes
    raise ValueError(f"unknown synchronisation {sync.name!r}")


def line_rate_bytes(rate_bits: float) -> float:
    """The payload bytes/s a link of ``rate_bits`` carries at best (TCP/IP over Ethernet)."""
    return rate_bits / 8 * TCP_PAYLOAD_FRACTION


def step_seconds(base_step_s: float, wire_bytes: float, base_bw: float, bw: float) -> float:
    """A step's seconds on a link of ``bw`` bytes/s, from one measured on a link of ``base_bw``:
    the link's share grows by what the bytes take at the slower rate; the rest stays."""
    return base_step_s + wire_bytes * (1 / bw - 1 / base_bw)


def sync_of(strategy: StrategyConfig) -> Sync:
    """The synchronisation a run's strategy settings train under (bf16 compression moves the
    bytes fp16 does)."""
    if strategy.name == "local-sgd":
        name = "diloco" if strategy.outer_momentum > 0 else "local-sgd"
        return Sync(name, every=strategy.sync_every)
    if strategy.compression == "powersgd":
        return Sync(
            "powersgd", rank=strategy.powersgd_rank, start_iter=strategy.powersgd_start_iter
        )
    return Sync("ddp" if strategy.compression == "none" else "ddp-fp16")


def ddp_buckets(shapes: Sequence[Sequence[int]], bucket_mb: float = 25.0) -> int:
    """The gradient buckets DDP's reducer makes of fp32 parameters of ``shapes`` once it has
    rebuilt them after the first step: the last parameters first, each bucket closed once it
    holds its cap, 1 MiB for the first and ``bucket_mb`` MiB for every other (torch's
    defaults)."""
    buckets, filled = 0, None
    for shape in reversed(shapes):
        if filled is None:
            buckets, filled = buckets + 1, 0.0
        filled += FP32 * math.prod(shape)
        if filled >= (2**20 if buckets == 1 else bucket_mb * 2**20):
            filled = None
    return buckets


def data_parallel_step(
    sync: Sync,
    shapes: Sequence[Sequence[int]],
    ranks: int,
    ddp: tuple[float, float, float],
    *,
    gloo: bool = False,
    latency_s: float = 0.0,
    hook_s: float = 0.0,
) -> tuple[float, float, float]:
    """(step, communication, exposed communication) seconds of a data-parallel step under
    ``sync``, from DDP's ``ddp`` = (step, communication, exposed) on the same link, once many
    steps have run (PowerSGD past its plain start).

    The bytes scale the communication. A gradient hook's collectives overlap the backward pass
    as DDP's did: what DDP hid stays hidden, the rest shows. Local SGD and DiLoCo average the
    parameters after the step, where nothing overlaps them. PowerSGD on gloo hides nothing:
    distml runs its hook one bucket at a time (:mod:`distml.parallel.data`), and the hook's
    three all-reduces a bucket (the uncompressed tensors, P, Q) go one after the other, each
    paying the link's ``latency_s``. ``hook_s``: the hook's own work a step on these workers
    (:mod:`distml.plan.hook_probe` measures it), added to the step."""
    step_s, comm_s, exposed_s = ddp
    steps = 10**6
    ratio = wire_bytes_per_step(sync, shapes, ranks, steps=steps, gloo=gloo) / (
        wire_bytes_per_step(DDP, shapes, ranks, steps=steps, gloo=gloo)
    )
    comm = comm_s * ratio
    if sync.name == "powersgd" and gloo:
        exposed = comm + 3 * ddp_buckets(shapes) * latency_s
    elif sync.averages_parameters:
        exposed = comm
    else:
        exposed = max(0.0, comm - (comm_s - exposed_s))
    return step_s - exposed_s + exposed + hook_s, comm, exposed


def steps_to_target(curve: Sequence[tuple[int, float]], target: float, tol: float = 1e-3):
    """The first evaluated step whose loss is at most ``target`` (+ ``tol``); None if none."""
    return next((step for step, loss in curve if loss <= target + tol), None)


@dataclass(frozen=True)
class Choice:
    label: str
    step_s: float
    steps: int | None
    time_to_target_s: float | None


def choose(step_s: Mapping[str, float], steps: Mapping[str, int | None]) -> list[Choice]:
    """Every strategy with its predicted time to the target, fastest first (those that never
    reach it last, by step time)."""
    choices = [
        Choice(label, s, steps.get(label), None if steps.get(label) is None else steps[label] * s)
        for label, s in step_s.items()
    ]
    return sorted(
        choices, key=lambda c: (c.time_to_target_s is None, c.time_to_target_s or c.step_s)
    )
