"""A shard's snapshot: parameters, optimizer state, version, worker clocks and the batches handed
out, in one safetensors file (JSON metadata for the rest), written atomically; no pickle.

A shard that restarts loads its latest snapshot; the updates applied after it are lost, at most
``snapshot_every`` of them, and the batches handed out after it are handed out again.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from distml.ps.optimizer_spec import build_optimizer, validate_optimizer_spec
from distml.ps.shard import ParameterShard, WorkerState


def _names_in_optimizer_order(
    params: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer
) -> list[str]:
    """Parameter names in the order of the optimizer's state-dict indices."""
    by_id = {id(p): n for n, p in params.items()}
    return [by_id[id(p)] for group in optimizer.param_groups for p in group["params"]]


def save_snapshot(shard: ParameterShard, path: Path) -> Path:
    """Write ``shard``'s state to ``path`` (through a temporary file and a rename). Hold the
    shard's lock while calling it."""
    tensors = {f"param/{n}": p.detach() for n, p in shard.params.items()}
    names = _names_in_optimizer_order(shard.params, shard.optimizer)
    state = shard.optimizer.state_dict()
    scalars: dict[str, dict[str, float]] = {}
    for index, entries in state["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim/{names[index]}/{key}"] = value
            else:
                scalars.setdefault(names[index], {})[key] = value
    meta = {
        "claims": {str(e): n for e, n in shard.claims.items()},
        "claimed": {str(w): n for w, n in shard.claimed.items()},
        "epoch_batches": shard.epoch_batches,
        "version": shard.version,
        "optimizer_spec": shard.optimizer_spec,
        "optimizer_scalars": scalars,
        "workers": {
            str(w): {"clock": s.clock, "last_answer": s.last_answer, "last_claim": s.last_claim}
            for w, s in shard.workers.items()
        },
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, tmp, metadata={"distml": json.dumps(meta)}
    )
    os.replace(tmp, path)
    return path


def load_snapshot(shard: ParameterShard, path: Path) -> None:
    """Restore ``shard`` from ``path``: it carries on at the snapshot's version."""

    with safe_open(path, "pt") as f:
        meta = json.loads(f.metadata()["distml"])
    tensors = load_file(path)
    params = {
        k.removeprefix("param/"): torch.nn.Parameter(v, requires_grad=True)
        for k, v in tensors.items()
        if k.startswith("param/")
    }
    spec = validate_optimizer_spec(meta["optimizer_spec"])
    optimizer = build_optimizer(spec, params)
    names = _names_in_optimizer_order(params, optimizer)
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        if key.startswith("optim/"):
            name, _, entry = key.removeprefix("optim/").rpartition("/")
            state.setdefault(names.index(name), {})[entry] = value
    for name, entries in meta["optimizer_scalars"].items():
        state.setdefault(names.index(name), {}).update(entries)
    saved = optimizer.state_dict()
    optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})
    shard.params = params
    shard.optimizer = optimizer
    shard.optimizer_spec = spec
    shard.version = shard.restored_version = int(meta["version"])
    shard.workers = {
        int(w): WorkerState(
            clock=s["clock"], last_answer=s["last_answer"], last_claim=s.get("last_claim")
        )
        for w, s in meta["workers"].items()
    }
    shard.claims = {int(e): int(n) for e, n in meta.get("claims", {}).items()}
    shard.claimed = Counter({int(w): int(n) for w, n in meta.get("claimed", {}).items()})
    shard.epoch_batches = meta.get("epoch_batches")
