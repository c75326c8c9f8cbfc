"""Checkpoints with ``torch.distributed.checkpoint`` (DCP), and a safetensors export.

A checkpoint holds the model, the optimizer, the step, the data-loader position and every rank's
RNG state, all as tensors: no Python object is pickled into it. DCP's metadata file is a pickle;
it is read back with an unpickler that admits only DCP's own metadata classes, and the few
non-tensor values (an optimizer's hyperparameters) with ``torch.load(weights_only=True)``, so
loading never runs code from the file. Each save goes to ``step_<N>/`` and becomes current only
when complete (the ``latest`` file is replaced atomically afterwards), so a crash during a save
leaves the previous checkpoint in force.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file, save_model
from torch import nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

_SAFE_TORCH_NAMES = {"Size", "device"} | {
    name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            module.startswith("torch.distributed.checkpoint.")
            or (module == "torch" and name in _SAFE_TORCH_NAMES)
            or (module == "torch.serialization" and name == "_get_layout")  # a name lookup
            or (module == "pathlib" and name in {"PosixPath", "PurePosixPath"})
            or (module == "collections" and name == "OrderedDict")
            or (module == "builtins" and name in {"set", "frozenset", "slice"})
        )
        if not allowed:
            raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}")
        return super().find_class(module, name)


class SafeFileSystemReader(dcp.FileSystemReader):
    """A DCP reader whose metadata load admits only DCP's own classes."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = Path(self.path) / ".metadata"
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner reads non-tensor items (an optimizer's lr, betas...) with
    ``torch.load(weights_only=False)``; this one admits only plain data."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def latest_checkpoint(root: Path) -> Path | None:
    marker = Path(root) / "latest"
    if not marker.exists():
        return None
    path = Path(root) / marker.read_text().strip()
    return path if path.is_dir() else None


def save_checkpoint(
    root: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, torch.Tensor],
    keep: int = 2,
) -> Path:
    """Save on every rank (a collective); returns the new checkpoint's folder."""
    root = Path(root)
    path = root / f"step_{step:08d}"
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, "extra": extra}, checkpoint_id=path)
    dist.barrier()
    if dist.get_rank() == 0:
        tmp = root / "latest.tmp"
        tmp.write_text(path.name)
        os.replace(tmp, root / "latest")
        for old in sorted(root.glob("step_*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return path


def checkpoint_keys(path: Path) -> set[str]:
    """The flattened keys a checkpoint holds, e.g. ``extra.step``."""
    return set(SafeFileSystemReader(path).read_metadata().state_dict_metadata)


def load_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Load in place on every rank (a collective). ``extra`` names the tensors to read back."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "extra": extra}
    dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    return state["extra"]


def export_safetensors(model: nn.Module, path: Path) -> Path:
    """The full, unsharded parameters and buffers of ``model`` in one safetensors file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_model(model, str(path))
    return path


def param_norm(model: nn.Module) -> float:
    """float64 L2 norm of all parameters: one number to compare two runs by."""
    return norm_of(model.parameters())


def norm_of(tensors: Any) -> float:
    total = torch.zeros((), dtype=torch.float64)
    for p in tensors:
        total += p.detach().to("cpu", torch.float64).pow(2).sum()
    return float(total.sqrt())


_WRAPPED = "_checkpoint_wrapped_module."


def gather_full_state(
    model: nn.Module, leaders: list[int]
) -> tuple[dict[str, torch.Tensor], set[str]] | None:
    """The whole model's unsharded state on rank 0 (None elsewhere), and which keys are
    parameters; a collective of every rank.

    Each rank holds a piece of the model (``model``: its pipeline stage, sharded by FSDP or
    tensor parallelism). DTensors are gathered within each stage; ``leaders[k]``, one rank of
    pipeline stage k, then sends its stage's tensors to rank 0, described first as JSON (names,
    shapes, dtypes) so that nothing but tensors travels.
    """
    from torch.distributed.tensor import DTensor

    from distml.runtime.collectives import all_gather_json

    params = {name.replace(_WRAPPED, "") for name, _ in model.named_parameters()}
    local: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        full = t.full_tensor() if isinstance(t, DTensor) else t
        local[name.replace(_WRAPPED, "")] = full.detach().to(
            "cpu", copy=True
        )  # a snapshot, not a view
    rank = dist.get_rank()
    mine = (
        [
            [n, list(t.shape), str(t.dtype).removeprefix("torch."), n in params]
            for n, t in local.items()
        ]
        if rank in leaders
        else []
    )
    device = next(model.parameters()).device
    described = all_gather_json(mine, device)
    if rank not in (0, *leaders):
        return None
    if rank != 0:
        for _, t in local.items():
            dist.send(t.contiguous().to(device), dst=0)
        return None
    state, names = dict(local), set(params)
    for src in leaders:
        if src == 0:
            continue
        for name, shape, dtype, is_param in described[src]:
            t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            dist.recv(t, src=src)
            state[name] = t.cpu()
            if is_param:
                names.add(name)
    return state, names


def export_state(state: dict[str, torch.Tensor], path: Path) -> Path:
    """Write a gathered full state (:func:`gather_full_state`) as one safetensors file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return path
