"""Synchronous data parallelism: torch DDP, with gradient compression and accounted traffic.

Every rank holds the whole model; DDP all-reduces gradient buckets as backward produces them
(Horovod-style ring all-reduce through gloo on CPU, NCCL on GPU). Compression is a DDP
communication hook: ``fp16``/``bf16`` halve the payload, ``powersgd`` sends low-rank factors
(Vogels et al. 2019). A thin wrapper around a compression hook reports each bucket's payload to
the step recorder, so ``comm_bytes`` counts what was actually sent.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

from distml.comm.collectives import ring_wire_bytes
from distml.config import StrategyConfig
from distml.parallel.strategy import StrategyEnv, TrainingStrategy


@dataclass
class _AccountedState:
    inner: Any
    accounting: Accounting
    world_size: int
    compression: str


def _bucket_payload(state: _AccountedState, bucket: dist.GradBucket, hook: Callable) -> Any:
    buffer = bucket.buffer()
    if state.compression in ("fp16", "bf16"):
        nbytes = buffer.numel() * 2
        result = hook(state.inner, bucket)
    elif state.compression == "powersgd":
        ps: powersgd.PowerSGDState = state.inner
        vanilla = ps.iter < ps.start_powerSGD_iter
        before = ps.total_numel_after_compression
        result = hook(ps, bucket)
        numel = buffer.numel() if vanilla else ps.total_numel_after_compression - before
        nbytes = numel * buffer.element_size()
    else:
        nbytes = buffer.numel() * buffer.element_size()
        result = hook(state.inner, bucket)
    state.accounting.add_comm(
        "all_reduce", nbytes, ring_wire_bytes("all_reduce", nbytes, state.world_size)
    )
    state.accounting.grads_ready()
    return result


def choose_hook(
    cfg: StrategyConfig,
    group: dist.ProcessGroup | None,
    waited: Callable[[float], None] | None = None,
) -> tuple[Callable, Any]:
    """The DDP communication hook ``cfg`` asks for over ``group``, and its state. ``waited``
    hears the seconds a hook that finishes its collectives before it returns (PowerSGD on gloo)
    blocked the backward pass waiting for them."""
    if cfg.compression == "fp16":
        return default_hooks.fp16_compress_hook, group
    if cfg.compression == "bf16":
        return default_hooks.bf16_compress_hook, group
    if cfg.compression == "powersgd":
        state = powersgd.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=cfg.powersgd_rank,
            start_powerSGD_iter=cfg.powersgd_start_iter,
        )
        hook = powersgd.powerSGD_hook
        if dist.get_backend(group) == "gloo":
            hook = _one_bucket_at_a_time(hook, waited)
        return hook, state
    return default_hooks.allreduce_hook, group


def _one_bucket_at_a_time(
    hook: Callable, waited: Callable[[float], None] | None = None
) -> Callable:
    """PowerSGD issues a bucket's second and third all-reduce from the callback of the one
    before. gloo matches collectives across ranks by the order they are issued in, and the
    callbacks of two buckets race, so with several buckets the ranks can issue them in different
    orders and abort ("Received data size doesn't match expected size"). On gloo each bucket's
    compression therefore finishes before the next bucket is handed over: correct, with less
    overlap of communication and backward."""

    def in_order(state, bucket):  # noqa: ANN001, ANN202  (DDP checks the hook's annotations)
        future = hook(state, bucket)
        start = time.perf_counter()
        future.wait()
        if waited is not None:
            waited(time.perf_counter() - start)
        return future

    return in_order


class Accounting(Protocol):
    """Where communication is reported: the step recorder."""

    def grads_ready(self) -> None: ...

    def add_comm(self, collective: str, nbytes: int, wire_bytes: int) -> None: ...

    def add_sync_wait(self, seconds: float) -> None: ...

    def add_exposed(self, seconds: float) -> None: ...


class DataParallel(TrainingStrategy):
    """Every rank holds the whole model; DDP all-reduces the gradients during backward."""

    def __init__(self, model: nn.Module, env: StrategyEnv):
        ddp, after_backward = apply_ddp(model, env.config.strategy, env.device, env.recorder)
        super().__init__(ddp, env)
        self._after_backward = after_backward

    @property
    def module(self) -> nn.Module:
        return self.model.module

    def no_sync(self) -> AbstractContextManager[None]:
        return self.model.no_sync()

    def after_backward(self) -> None:
        self._after_backward()


def apply_ddp(
    model: nn.Module,
    cfg: StrategyConfig,
    device: torch.device,
    accounting: Accounting,
    group: dist.ProcessGroup | None = None,
) -> tuple[DDP, Callable[[], None]]:
    """Wrap ``model`` (already on ``device``) in DDP, with its traffic accounted; returns DDP
    and what to account once a step's backward is done.

    Without compression no hook is registered: DDP's own C++ all-reduce is measurably faster
    than any Python hook (``benchmarks/ddp_overhead.py``). Its traffic is then known exactly
    without one, since every gradient bucket is all-reduced once per synchronising backward, and
    the end of local compute is the moment the last gradient is accumulated.
    """
    ddp = DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=group,
        bucket_cap_mb=cfg.bucket_cap_mb,
    )
    world = dist.get_world_size(group)
    if cfg.compression == "none":
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            p.register_post_accumulate_grad_hook(lambda _: accounting.grads_ready())
        nbytes = sum(p.numel() * p.element_size() for p in params)
        wire = ring_wire_bytes("all_reduce", nbytes, world)
        return ddp, lambda: accounting.add_comm("all_reduce", nbytes, wire)

    # A hook that waits for its collectives holds the backward pass meanwhile: that wait is
    # communication the step is exposed to, which the end of backward alone would not show.
    hook, inner = choose_hook(cfg, group, waited=accounting.add_exposed)
    state = _AccountedState(inner, accounting, world, cfg.compression)

    # No annotations here: DDP checks them, and this module's postponed (string) annotations
    # would not compare equal to dist.GradBucket.
    def accounted(state, bucket):  # noqa: ANN001
        return _bucket_payload(state, bucket, hook)

    ddp.register_comm_hook(state, accounted)
    return ddp, lambda: None  # the hook reports each bucket as it is handed over
