"""A user's own model under a tensor-parallel plan and pipeline split points from the config."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import distml
from conftest import rel_err

pytestmark = pytest.mark.distributed  # every test starts processes

STEPS, BATCH = 5, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Tower(nn.Module):
    """Follows the pipeline contract: blocks in a ModuleDict, missing modules skipped."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleDict({str(i): Block() for i in range(4)})
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        if self.inp is not None:
            x = self.inp(x)
        for block in self.blocks.values():
            x = block(x)
        return self.out(x) if self.out is not None else x


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(STEPS, BATCH, 8, generator=g), torch.randint(
        0, 4, (STEPS, BATCH), generator=g
    )


def worker(ctx: distml.Context) -> dict:
    model = Tower()
    model, optimizer = ctx.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    xs, ys = data()
    for x, y in zip(xs, ys, strict=True):
        ctx.train_step((x, y), loss=F.cross_entropy)
    state = ctx.full_state_dict()
    return state[0] if state else None


def single_process() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Tower()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in zip(*data(), strict=True):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.state_dict()


def launch(tmp_path, **parallel):
    return distml.launch(
        worker,
        nproc=4,
        mesh={"tp": 2, "pp": 2},
        parallel={"microbatches": 2, **parallel},
        runs_dir=tmp_path,
        run_name="tower",
        telemetry={"progress": False},
    )


def test_tp_plan_and_split_points_equal_one_process(tmp_path):
    state = launch(
        tmp_path,
        tp_plan={"blocks.*.up": "colwise", "blocks.*.down": "rowwise"},
        split_points=["blocks.1"],
    )
    expected = single_process()
    assert sorted(state) == sorted(expected)
    for name, value in expected.items():
        assert rel_err(state[name], value) <= 1e-4, name


def test_a_plan_naming_no_module_is_refused(tmp_path):
    with pytest.raises(distml.LaunchError, match="tp_plan: 'blocks.\\*.fc' names no module"):
        launch(tmp_path, tp_plan={"blocks.*.fc": "colwise"})
