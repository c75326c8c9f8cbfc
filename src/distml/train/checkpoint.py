"""Checkpoints with ``torch.distributed.checkpoint`` (DCP), and a safetensors export.

A checkpoint holds the model, the optimizer, the step, the data-loader position and every rank's
RNG state, all as tensors: no Python object is pickled into it. DCP's metadata file is a pickle;
it is read back with an unpickler that admits only DCP's own metadata classes, and the few
non-tensor values (an optimizer's hyperparameters) with ``torch.load(weights_only=True)``, so
loading never runs code from the file. Each save goes to ``step_<N>/`` and becomes current only
when complete (the ``latest`` file is replaced atomically afterwards), so a crash during a save
leaves the previous checkpoint in force.

Fine-tuning and batch inference start from a checkpoint's model weights alone
(:func:`load_weights`): read whole into the plain model, whatever layout saved them, or from an
exported safetensors file.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file, save_model
from torch import nn

from distml.config import ConfigError, read_toml
from distml.net.untrusted import bounded_json

# torch.distributed.checkpoint (and distml.train.safe_dcp, built on it) is imported in the
# functions that read or write DCP folders: its import costs about 2 s beyond torch's, which a
# replica serving a safetensors export, or any plain-file checkpoint, never needs.

# DCP (and the DTensor package it brings) is imported by the functions that touch a checkpoint:
# half a second of every worker's start-up otherwise, for runs that never save one.


_STEP_NAME = re.compile(r"step_[0-9]{1,20}")
MAX_SUMMARY_BYTES = 2**20  # a run's summary.json is a few KB


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint the ``latest`` file of ``root`` names: a ``step_N`` folder of ``root``
    itself, whatever the file says (a folder handed over by someone else may name any path)."""
    marker = Path(root) / "latest"
    if not marker.is_file():
        return None
    try:
        with open(marker, "rb") as f:
            name = f.read(64).decode("ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {marker}: {exc}") from None
    if not _STEP_NAME.fullmatch(name):
        raise ConfigError(f"{marker} names {name!r}, not a step_N checkpoint of {root}")
    path = Path(root) / name
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
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

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
    from distml.train.safe_dcp import SafeFileSystemReader

    return set(SafeFileSystemReader(path).read_metadata().state_dict_metadata)


def load_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Load in place on every rank (a collective). ``extra`` names the tensors to read back."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from distml.train.safe_dcp import SafeFileSystemReader, SafeLoadPlanner

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "extra": extra}
    dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    return state["extra"]


def resolve_weights(source: Path | str) -> Path:
    """Where the weights of ``source`` are, for training, inference and serving alike: a file as
    it is (read as safetensors); a DCP checkpoint (a ``step_N/`` folder) as it is; a checkpoint
    folder's latest; a run folder's export (``summary.json``'s ``export``, else
    ``model.safetensors``: the end of the run), else its latest checkpoint."""
    path = Path(source)
    if path.is_file() or (path / ".metadata").is_file():
        return path
    if not path.is_dir():
        raise ConfigError(f"no weights at {path}: no checkpoint, run folder or file there")
    candidates = [
        latest_checkpoint(path),
        _export_of(path),
        path / "model.safetensors" if (path / "model.safetensors").is_file() else None,
        latest_checkpoint(path / "checkpoint"),
    ]
    for candidate in candidates:
        if candidate is not None:
            return candidate
    raise ConfigError(
        f"no weights at {path}: expected a .safetensors file, a checkpoint folder or a run folder"
    )


def _export_of(run: Path) -> Path | None:
    """The exported file that a run's ``summary.json`` names, if it exists. A folder handed over
    by someone else may hold any file there, so it is read bounded and a bad one is a
    :class:`ConfigError`."""
    summary = run / "summary.json"
    if not summary.is_file():
        return None
    try:
        with open(summary, "rb") as f:
            data = f.read(MAX_SUMMARY_BYTES + 1)
        record = bounded_json(data, max_bytes=MAX_SUMMARY_BYTES, max_depth=64)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {summary}: {exc}") from None
    export = record.get("export") if isinstance(record, dict) else None
    if export is not None and not isinstance(export, str):
        raise ConfigError(f"{summary}: export is a {type(export).__name__}, not a path")
    return Path(export) if export and Path(export).is_file() else None


def model_settings_near(source: Path | str) -> dict[str, Any]:
    """The ``[model]`` table of the run that ``source`` belongs to: the first ``config.toml``
    in its folder or the two above (a run folder, its ``checkpoint/``, a ``step_N/``)."""
    path = Path(source).resolve()
    folder = path if path.is_dir() else path.parent
    for candidate in [folder, *folder.parents][:3]:
        config = candidate / "config.toml"
        if config.is_file():
            model = read_toml(config, "config").get("model") or {}
            if not isinstance(model, dict):
                raise ConfigError(f"{config}: [model] is a {type(model).__name__}, not a table")
            return model
    return {}


def _stored_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the model tensors stored at ``path``, read without the data."""
    if path.is_file():
        try:
            with safe_open(str(path), framework="pt") as f:
                return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        except (SafetensorError, OSError) as exc:
            raise ConfigError(f"{path} is not a readable safetensors file: {exc}") from None
    from distml.train.safe_dcp import SafeFileSystemReader

    items = SafeFileSystemReader(path).read_metadata().state_dict_metadata  # CheckpointError
    return {
        k.removeprefix("model."): tuple(v.size)
        for k, v in items.items()
        if k.startswith("model.") and hasattr(v, "size")
    }


def check_weights(model: nn.Module, path: Path) -> None:
    """Refuse, with the names, weights at ``path`` that do not fit ``model`` exactly."""
    stored = _stored_shapes(path)
    wanted = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(wanted.keys() - stored.keys())
    unexpected = sorted(stored.keys() - wanted.keys())
    shapes = [
        f"{k} is {list(stored[k])} there, {list(wanted[k])} in the model"
        for k in sorted(wanted.keys() & stored.keys())
        if stored[k] != wanted[k]
    ]
    problems = [
        *([f"missing {', '.join(missing[:5])}"] if missing else []),
        *([f"unexpected {', '.join(unexpected[:5])}"] if unexpected else []),
        *shapes[:5],
    ]
    if problems:
        raise ConfigError(f"{path} does not fit a {type(model).__name__}: {'; '.join(problems)}")


def load_weights(model: nn.Module, source: Path | str) -> Path:
    """Load the weights of ``source`` (see :func:`resolve_weights`) into the plain ``model``,
    whole on every rank, whatever layout saved them: DCP reads each saved shard into the full
    tensors (resharding), and the optimizer, step and RNG states of a checkpoint are left
    unread. Every rank calls it when ``source`` is a DCP checkpoint (a collective).
    Returns the path read.

    >>> load_weights(DigitsCNN(), "runs/digits/checkpoint")  # doctest: +SKIP
    """
    path = resolve_weights(source)
    check_weights(model, path)
    if path.is_file():
        model.load_state_dict(load_file(str(path)), strict=True)
        return path
    import torch.distributed.checkpoint as dcp

    from distml.train.safe_dcp import SafeFileSystemReader, SafeLoadPlanner

    state = {"model": model.state_dict()}
    alone = not dist.is_initialized()  # one plain process reads it by itself
    with warnings.catch_warnings():
        if alone:  # DCP warns that this is what it assumes: here it is what is meant
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(
            state,
            storage_reader=SafeFileSystemReader(path),
            planner=SafeLoadPlanner(),
            no_dist=alone,
        )
    model.load_state_dict(state["model"], strict=True)
    return path


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

    from distml.comm.collectives import all_gather_json

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
