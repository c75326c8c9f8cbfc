"""Checkpoints move between layouts: saved sharded one way, loaded sharded another (or whole)."""

from __future__ import annotations

import pytest
import torch
from gpt_oracle import CFG, corpus
from safetensors.torch import load_file

import distml
from conftest import rel_err
from distml.data import ShardedBatchSampler
from distml.models import GPT, lm_loss

pytestmark = pytest.mark.distributed  # every test starts processes

GLOBAL_BATCH = 8
FIRST, TOTAL = 3, 6


def flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([state[k].reshape(-1).double() for k in sorted(state)])


def segment(ctx: distml.Context, out_dir: str, stop: int) -> dict:
    """Train AdamW from the run's latest checkpoint (if any) up to step ``stop``, save."""
    model = GPT(CFG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = ctx.setup(model, optimizer)
    loader = ctx.dataloader(corpus(), batch_size=GLOBAL_BATCH // ctx.data_world)
    resumed = ctx.load_checkpoint()
    loaded = ctx.full_state_dict()  # what the checkpoint put into this layout
    while ctx.step < stop:
        for batch in loader:
            ctx.train_step(batch, loss=lm_loss)
            if ctx.step == stop:
                break
    ctx.save_checkpoint()
    ctx.finish()
    return {"resumed": resumed, "loaded": loaded[0] if loaded else None}


def run(tmp_path, stop: int, nproc: int, mesh: dict | None) -> dict:
    return distml.launch(
        segment,
        str(tmp_path),
        stop,
        nproc=nproc,
        mesh=mesh,
        runs_dir=tmp_path,
        run_name="job",
        telemetry={"progress": False},
    )


def uninterrupted(steps: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(CFG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = corpus()
    for i, idx in enumerate(ShardedBatchSampler(len(data), GLOBAL_BATCH, 0, 1, seed=0)):
        if i == steps:
            break
        x, y = data[idx]
        optimizer.zero_grad()
        lm_loss(model(x), y).backward()
        optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "second",
    [pytest.param((2, {"pp": 2}), id="to-pp2"), pytest.param((1, None), id="to-one-process")],
)
def test_fsdp_x_tp_checkpoint_loads_into_another_layout_and_training_continues(tmp_path, second):
    first = run(tmp_path, FIRST, 4, {"fsdp": 2, "tp": 2})
    saved = load_file(str(tmp_path / "job" / "model.safetensors"))
    assert not first["resumed"]
    nproc, mesh = second
    out = run(tmp_path, TOTAL, nproc, mesh)
    assert out["resumed"]
    assert torch.equal(flat(out["loaded"]), flat(saved))  # identical parameters, resharded
    final = load_file(str(tmp_path / "job" / "model.safetensors"))
    # Adam's moments came along too: the same parameters as six uninterrupted steps.
    assert rel_err(flat(final), flat(uninterrupted(TOTAL))) <= 1e-4
