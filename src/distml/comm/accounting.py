"""Measure the collectives a step issues, whoever issues them: DTensor, FSDP2 or pipelining.

Every torch collective passes through the dispatcher as a ``c10d`` (process-group API) or
``_c10d_functional`` (DTensor) operator, so one dispatch mode sees them all. It sums each one's
payload (see :mod:`distml.comm.collectives` for what payload and wire bytes mean) and the time
this rank spends blocked in it: in the operator, in a functional collective's ``wait_tensor``,
and in ``Work.wait()`` on what an operator issued asynchronously, which is where FSDP2's
all-gathers and reduce-scatters and the pipeline's sends and receives wait on CPU (gloo).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from distml.comm.collectives import ring_wire_bytes


def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


def _group(arg: Any) -> dist.ProcessGroup:
    if isinstance(arg, str):  # functional collectives name their group
        return dist.distributed_c10d._resolve_process_group(arg)
    if isinstance(arg, torch.ScriptObject):  # what the dispatcher passes for a ProcessGroup
        return dist.ProcessGroup.unbox(arg)
    return arg


def _wire_bytes(collective: str, full: int, group: dist.ProcessGroup) -> int:
    """What a ring moves out of this rank. gloo has no reduce-scatter of its own: torch
    all-reduces the whole input there and keeps this rank's part, so it moves 2(N-1)/N of the
    input, not (N-1)/N (measured on the interface of a testbed host: FSDP's step sent an
    all-reduce's worth for its gradients)."""
    n = group.size()
    if collective == "reduce_scatter" and dist.get_backend(group) == "gloo":
        return ring_wire_bytes("all_reduce", full, n)
    return ring_wire_bytes(collective, full, n)


# op name -> (collective, index of the payload argument, index of the group argument)
_OPS: dict[str, tuple[str, int, int]] = {
    "c10d::allreduce_": ("all_reduce", 0, 1),
    "_c10d_functional::all_reduce": ("all_reduce", 0, 2),
    "_c10d_functional::all_reduce_": ("all_reduce", 0, 2),
    "c10d::_allgather_base_": ("all_gather", 1, 2),
    "c10d::allgather_": ("all_gather", 1, 2),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", 1, 2),
    "_c10d_functional::all_gather_into_tensor": ("all_gather", 0, 2),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", 1, 2),
    "c10d::reduce_scatter_": ("reduce_scatter", 1, 2),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, 2),
    "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", 0, 3),
    "c10d::broadcast_": ("broadcast", 0, 1),
    "_c10d_functional::broadcast": ("broadcast", 0, 2),
    "c10d::send": ("send", 0, -1),
    "c10d::recv_": ("recv", 0, -1),
    "_c10d_functional::all_to_all_single": ("all_to_all", 0, -1),
}
_WAITS = {"_c10d_functional::wait_tensor"}


class CommAccounting(TorchDispatchMode):
    """Calls ``report(collective, payload_bytes, wire_bytes)`` for every collective, and adds
    the seconds spent inside collectives and waits to ``blocked_s``.

    All-gather payload is what this rank contributes (its shard), its wire bytes (N-1)/N of the
    gathered tensor; point-to-point wire bytes are the payload.
    """

    def __init__(self, report: Callable[[str, int, int], None]):
        super().__init__()
        self.report = report
        self.blocked_s = 0.0
        self._wait: Callable[..., Any] | None = None

    def __enter__(self) -> CommAccounting:
        # Work.wait is a method of torch's C++ class, not an operator: while this mode is on,
        # the waits of the thread that turned it on are timed too, and nothing else changes.
        self._wait = original = dist.Work.wait
        thread = threading.get_ident()

        def timed_wait(work: dist.Work, *args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != thread:
                return original(work, *args, **kwargs)
            start = time.perf_counter()
            try:
                return original(work, *args, **kwargs)
            finally:
                self.blocked_s += time.perf_counter() - start

        dist.Work.wait = timed_wait
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            dist.Work.wait = self._wait

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        name = func._schema.name
        entry = _OPS.get(name)
        if entry is None and name not in _WAITS:
            return func(*args, **kwargs)
        start = time.perf_counter()
        out = func(*args, **kwargs)
        self.blocked_s += time.perf_counter() - start
        if entry is not None:
            collective, payload_at, group_at = entry
            payload = _nbytes(args[payload_at])
            if collective in ("send", "recv"):
                self.report(collective, payload, payload)
            elif (group := _group(args[group_at])).size() > 1:  # a group of one moves nothing
                full = payload * group.size() if collective == "all_gather" else payload
                self.report(collective, payload, _wire_bytes(collective, full, group))
        return out
