"""Memory per rank: model state (parameters, gradients, optimizer state) and activations.

Model state is summed from the local tensors a rank holds (a shard's own bytes under FSDP or
tensor parallelism, not the logical size). Activations are the tensors autograd keeps for
backward: a ``saved_tensors_hooks`` pair counts each storage once while any saved reference to
it is alive, and the peak over a step is the step's activation memory. It works on any device,
unlike the CUDA allocator's counters, and it is the quantity pipeline schedules and activation
checkpointing trade: 1F1B bounds how many micro-batches are in flight, checkpointing keeps one
tensor a block.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """Bytes this rank holds of parameters, gradients and optimizer state."""
    params = list(model.parameters())
    state = []
    if optimizer is not None:
        for per_param in optimizer.state.values():
            state.extend(v for v in per_param.values() if isinstance(v, torch.Tensor))
    return {
        "params": tensor_bytes(params),
        "grads": tensor_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": tensor_bytes(t for t in state if t.dim() > 0),  # scalar steps: noise
    }


class ParameterPeak:
    """``with ParameterPeak(model):`` the parameter bytes ``model`` holds at the end of each of
    its forwards. FSDP with ``reshard_after_forward=False`` (ZeRO-2) keeps the whole parameters
    from forward until backward, and the root module's always: memory that a count at rest,
    after the optimizer step, does not see."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.peak_bytes = 0
        self._handle = None

    def _count(self, module: nn.Module, args: object, output: object) -> None:
        self.peak_bytes = max(self.peak_bytes, tensor_bytes(module.parameters()))

    def __enter__(self) -> ParameterPeak:
        self._handle = self.model.register_forward_hook(self._count)
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.remove()


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter, or a view of one (a matmul saves its weight transposed)."""
    base = t._base if t._base is not None else t
    return isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad)


class _Saved:
    """What autograd holds instead of the tensor; its death releases the count.

    It keeps the tensor detached: a saved output holding its own ``grad_fn`` would close a
    cycle through autograd's C++ graph that Python's collector cannot see, and a graph that is
    never run backward (a pipeline stage's shape inference) would then live, and be counted,
    for ever.
    """

    __slots__ = ("tensor", "key", "tracker")

    def __init__(self, tensor: torch.Tensor, key: int | None, tracker: ActivationTracker):
        self.tensor = tensor
        self.key = key
        self.tracker = tracker

    def __del__(self) -> None:
        if self.key is not None:
            self.tracker._release(self.key)


class ActivationTracker:
    """``with tracker: loss.backward()``-spanning context; ``peak_bytes`` after.

    Parameters saved for backward (a weight in a matmul) are model state, not activations, and
    are left out; a storage saved by several operators counts once.
    """

    def __init__(self) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0
        self._refs: dict[int, list[int]] = {}  # storage key -> [references, bytes]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def reset(self) -> None:
        self.peak_bytes = self.live_bytes

    def _pack(self, t: torch.Tensor) -> _Saved:
        local = _local(t)
        if _is_parameter(t) or local.device.type == "meta":
            return _Saved(t.detach(), None, self)
        storage = local.untyped_storage()
        key = storage.data_ptr()
        entry = self._refs.get(key)
        if entry is None:
            self._refs[key] = [1, storage.nbytes()]
            self.live_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        else:
            entry[0] += 1
        return _Saved(t.detach(), key, self)

    @staticmethod
    def _unpack(saved: _Saved) -> torch.Tensor:
        return saved.tensor

    def _release(self, key: int) -> None:
        entry = self._refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live_bytes -= entry[1]
            del self._refs[key]

    def __enter__(self) -> ActivationTracker:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
