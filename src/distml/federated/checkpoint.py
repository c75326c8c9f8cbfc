"""The federated server's checkpoint, written after every completed round: one safetensors file
with the global model and the strategy's state (a server optimizer's moments, a privacy ledger)
as tensors, and the rest (round, history, clients) as JSON in its metadata. It is written to a
temporary name and renamed, so a crash leaves the previous round's checkpoint whole. No pickle.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from distml.federated.privacy import ledger_of

FILE = "global.safetensors"


def save_checkpoint(
    directory: Path,
    *,
    params: dict[str, torch.Tensor],
    strategy_state: dict[str, torch.Tensor],
    state: dict[str, Any],
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {f"param/{n}": t.contiguous() for n, t in params.items()}
    tensors |= {f"strategy/{n}": t.contiguous() for n, t in strategy_state.items()}
    path = directory / FILE
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, tmp, metadata={"state": json.dumps(state)})
    os.replace(tmp, path)
    return path


def load_checkpoint(
    directory: Path,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
    """(params, strategy state, state) of the last completed round."""
    path = directory / FILE
    with safe_open(path, "pt") as f:
        state = json.loads((f.metadata() or {}).get("state", "{}"))
    tensors = load_file(path)
    params = {k[6:]: t for k, t in tensors.items() if k.startswith("param/")}
    strategy = {k[9:]: t for k, t in tensors.items() if k.startswith("strategy/")}
    legacy = state.pop("dp", None)  # the privacy ledger, before it was the strategy's state
    if isinstance(legacy, dict) and legacy.get("history"):
        strategy = ledger_of(legacy["history"]) | strategy
    return params, strategy, state
