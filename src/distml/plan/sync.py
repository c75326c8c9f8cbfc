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
less than the line rate), each collective at its own (gloo's all-gather of a block reached
0.4-0.9 of its all-reduce's rate on the shaped links of BENCHMARKS.md); :func:`line_rate_bytes`
is the best a rate alone can say. Strategies
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
from distml.plan.simulator import pipeline_step_s

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


def wire_bytes_by_collective(
    sync: Sync,
    shapes: Sequence[Sequence[int]],
    ranks: int,
    *,
    steps: int,
    boundary_activation_bytes: float = 0.0,
    gloo: bool = False,
) -> dict[str, float]:
    """Bytes a step waits for on each rank's link (the mean over ``steps`` steps), by
    collective (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``send_recv``): what a ring
    sends from each rank (both directions of every link busy at once), or a pipeline's
    transfers end to end.

    ``boundary_activation_bytes``: under ``pipeline``, one step's activations at the stage
    boundary (global batch x sequence x hidden x 4 for fp32); their gradients come back the
    same size. ``gloo``: the backend has no reduce-scatter and all-reduces instead."""
    params = sum(math.prod(s) for s in shapes)
    full = _ring(ranks) * FP32 * params
    if sync.name == "ddp":
        return {"all_reduce": full}
    if sync.name == "ddp-fp16":
        return {"all_reduce": full / 2}
    if sync.name == "powersgd":
        plain = min(sync.start_iter, steps)
        compressed = _ring(ranks) * FP32 * powersgd_elements(shapes, sync.rank)
        return {"all_reduce": (plain * full + (steps - plain) * compressed) / steps}
    if sync.name in ("local-sgd", "diloco"):
        return {"all_reduce": full / sync.every}
    if sync.name == "fsdp":  # two all-gathers of (N-1)/N x 4P each
        return {"all_gather": full} | (
            {"all_reduce": full} if gloo else {"reduce_scatter": full / 2}
        )
    if sync.name == "pipeline":
        return {"send_recv": 2 * boundary_activation_bytes}
    raise ValueError(f"unknown synchronisation {sync.name!r}")


def wire_bytes_per_step(*args: Any, **kwargs: Any) -> float:
    """All the bytes of :func:`wire_bytes_by_collective` (which takes the same arguments)."""
    return sum(wire_bytes_by_collective(*args, **kwargs).values())


def link_seconds(wire: Mapping[str, float], bandwidth: Mapping[str, float]) -> float:
    """Seconds the bytes of :func:`wire_bytes_by_collective` take on a link whose collectives
    move ``bandwidth[name]`` bytes/s (the all-reduce's for a collective it has no figure for)."""
    return sum(n / bandwidth.get(name, bandwidth["all_reduce"]) for name, n in wire.items())


def line_rate_bytes(rate_bits: float) -> float:
    """The payload bytes/s a link of ``rate_bits`` carries at best (TCP/IP over Ethernet)."""
    return rate_bits / 8 * TCP_PAYLOAD_FRACTION


def step_seconds(
    base_step_s: float,
    wire: Mapping[str, float],
    base_bw: Mapping[str, float],
    bw: Mapping[str, float],
) -> float:
    """A step's seconds on a link whose collectives move ``bw[name]`` bytes/s, from one measured
    on a link of ``base_bw``: the link's share grows by what the bytes of each collective
    (:func:`wire_bytes_by_collective`) take at the slower rate; the rest stays."""
    return base_step_s + link_seconds(wire, bw) - link_seconds(wire, base_bw)


def pipeline_step_seconds(
    base_step_s: float,
    stages: int,
    micro: int,
    message_bytes: float,
    base_bw: Mapping[str, float],
    bw: Mapping[str, float],
) -> float:
    """A 1F1B step's seconds on a link of ``bw``, from one measured on a link of ``base_bw``:
    torch's schedule with its transfers (:func:`distml.plan.simulator.pipeline_step_s`,
    ``message_bytes`` a micro-batch each way), each micro-batch's forward and backward (twice
    the forward) set so that the schedule takes ``base_step_s`` on the base link. A link's
    ``send_recv`` rate is one way's (the all-reduce's where it has none), ``exchange`` each
    way's while both carry (one way's where it has none).

    Transfers end to end, as :func:`step_seconds` charges them, are right only where the two
    ways share the link's rate; where the link carries both at once, micro-batches' transfers
    overlap each other and the other stage's compute."""

    def step(links: Mapping[str, float], forward_s: float) -> float:
        one_way = links.get("send_recv", links["all_reduce"])
        both = min(links.get("exchange", one_way), one_way)
        return pipeline_step_s(
            stages, micro, forward_s, 2 * forward_s, message_bytes, one_way, both
        )

    low, high = 0.0, base_step_s  # the step grows with the compute: bisect for it
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if step(base_bw, mid) < base_step_s else (low, mid)
    return step(bw, low)


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
