"""Checkpoints: resume equivalence, safe loading, export."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import TensorDataset

import distml
from conftest import rel_err
from distml.train.checkpoint import param_norm
from distml.train.safe_dcp import CheckpointError, SafeFileSystemReader

K = 13  # not a multiple of the 15 batches per epoch: the resume lands mid-epoch


class DropoutNet(nn.Module):
    """Dropout makes the result depend on every rank's RNG state, so a resume must restore it."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 10))

    def forward(self, x):
        return self.net(x)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    return TensorDataset(
        torch.randn(250, 16, generator=g), torch.randint(0, 10, (250,), generator=g)
    )


def worker(ctx: distml.Context, stop_at: int, resume: bool) -> dict:
    model = DropoutNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer = ctx.setup(model, optimizer)
    loader = ctx.dataloader(dataset(), batch_size=8)
    if resume:
        assert ctx.load_checkpoint(), "no checkpoint to resume from"
    while ctx.step < stop_at:
        for x, y in loader:
            ctx.train_step((x, y), lambda b: F.cross_entropy(model(b[0]), b[1]))
            if ctx.step == stop_at:
                break
    ctx.save_checkpoint()
    summary = ctx.finish()
    params = torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])
    return {"params": params, "summary": summary, "step": ctx.step}


@pytest.mark.distributed
def test_resume_equals_uninterrupted(tmp_path):
    opts = {"nproc": 2, "runs_dir": tmp_path, "telemetry": {"progress": False}}
    straight = distml.launch(worker, 2 * K, False, run_name="straight", **opts)
    first = distml.launch(worker, K, False, run_name="resumed", **opts)
    second = distml.launch(worker, 2 * K, True, run_name="resumed", **opts)
    assert first["step"] == K and second["step"] == 2 * K
    assert rel_err(first["params"], straight["params"]) > 1e-3  # K steps are not 2K steps
    assert rel_err(second["params"], straight["params"]) <= 1e-6
    # The export holds the full parameters, and param_norm is their float64 norm.
    exported = load_file(second["summary"]["export"])
    model = DropoutNet()
    model.load_state_dict(exported)
    assert param_norm(model) == pytest.approx(second["summary"]["param_norm"], rel=1e-12)
    assert second["summary"]["param_norm"] == pytest.approx(
        straight["summary"]["param_norm"], rel=1e-6
    )


class _Boom:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_checkpoint_metadata_is_never_unpickled_freely(tmp_path: Path):
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Boom()))
    with pytest.raises(CheckpointError, match="posix.system|os.system"):
        SafeFileSystemReader(tmp_path).read_metadata()
