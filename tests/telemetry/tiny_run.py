"""The cheapest whole training run with a run folder: two ranks of DDP on a small MLP, a dozen
steps and an evaluation. The telemetry tests read its files (metrics.jsonl, tb/, report.html);
tests that use it start processes, so they carry ``@pytest.mark.distributed``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import distml
from distml.models import MLP

STEPS = 12


def _task(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and the index of their largest of the first four features: learnable, so the
    loss falls."""
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(seed))
    return x, x[:, :4].argmax(dim=1)


def train(ctx: distml.Context) -> dict[str, Any]:
    model = MLP((16, 32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    model, optimizer = ctx.setup(model, optimizer)
    x, y = _task(STEPS * 32, seed=ctx.rank)
    for batch in zip(x.split(32), y.split(32), strict=True):
        ctx.train_step(batch, lambda b: F.cross_entropy(model(b[0]), b[1]))
    return ctx.finish(eval=ctx.evaluate(model, TensorDataset(*_task(256, seed=99))))


def run_tiny(runs_dir: Path, name: str = "tiny") -> Path:
    """Train and return the run folder."""
    distml.launch(train, nproc=2, runs_dir=runs_dir, run_name=name, telemetry={"progress": False})
    return Path(runs_dir) / name


def shared_tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run folder, launched by the first test module of the session that asks for it and
    found by the others in the session's temporary folder."""
    runs_dir = tmp_path_factory.getbasetemp() / "shared-tiny-run"
    run = runs_dir / "tiny"
    if not (run / "report.html").exists():  # the last file a finished run writes
        run_tiny(runs_dir)
    return run
