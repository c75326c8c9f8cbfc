"""Local SGD / DiLoCo against its definition, simulated in one process."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from dp_oracle import BATCH, SIZES, dataset, single_process, train_worker

import distml
from conftest import rel_err
from distml.config import parse_strategy
from distml.data import ShardedBatchSampler
from distml.models import MLP

STEPS = 12


def worker(ctx: distml.Context, momentum: float) -> dict:
    return train_worker(ctx, STEPS, BATCH, momentum)


def by_definition(world: int, h: int, outer_lr: float, outer_momentum: float) -> torch.Tensor:
    """W replicas, each H local SGD-momentum steps on its shard; average the deltas; outer
    Nesterov SGD on the global parameters; repeat."""
    torch.manual_seed(0)
    global_model = MLP(SIZES)
    replicas = [copy.deepcopy(global_model) for _ in range(world)]
    inner = [torch.optim.SGD(r.parameters(), lr=0.1, momentum=0.9) for r in replicas]
    outer = torch.optim.SGD(
        global_model.parameters(), lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0
    )
    data = dataset()
    batches = [iter(ShardedBatchSampler(len(data), BATCH, r, world, seed=0)) for r in range(world)]
    for step in range(1, STEPS + 1):
        for r in range(world):
            x, y = data[next(batches[r])]
            inner[r].zero_grad()
            F.cross_entropy(replicas[r](x), y).backward()
            inner[r].step()
        if step % h == 0:
            with torch.no_grad():
                for g, *local in zip(
                    global_model.parameters(), *(r.parameters() for r in replicas), strict=True
                ):
                    g.grad = sum(g - p for p in local) / world
            outer.step()
            outer.zero_grad()
            for r in replicas:
                r.load_state_dict(global_model.state_dict())
    return torch.cat([p.detach().reshape(-1) for p in global_model.parameters()])


@pytest.mark.distributed
def test_diloco_equals_its_definition_and_communicates_h_times_less(tmp_path):
    h = 4
    strategy = {**parse_strategy("local-sgd:4"), "outer_lr": 0.7, "outer_momentum": 0.9}
    out = distml.launch(
        worker,
        0.9,
        nproc=2,
        runs_dir=tmp_path,
        run_name="diloco",
        strategy=strategy,
        telemetry={"progress": False},
    )
    expected = by_definition(2, h, 0.7, 0.9)
    assert rel_err(out["params"], expected) <= 1e-5
    assert out["summary"]["comm_bytes"]["all_reduce"] == (STEPS // h) * 4 * expected.numel()


@pytest.mark.distributed
def test_one_local_step_of_plain_sgd_with_averaging_is_synchronous_sgd(tmp_path):
    out = distml.launch(
        worker,
        0.0,
        nproc=2,
        runs_dir=tmp_path,
        run_name="h1",
        strategy={"name": "local-sgd", "sync_every": 1},
        telemetry={"progress": False},
    )
    # Averaging parameters after one SGD step = one SGD step with the averaged gradient.
    sync = single_process(STEPS, 2 * BATCH, momentum=0.0)
    assert rel_err(out["params"], sync) <= 1e-5


def test_local_sgd_refuses_gradient_compression():
    with pytest.raises(distml.config.ConfigError, match="gradient compression is for ddp"):
        distml.config.build_config(strategy={"name": "local-sgd", "compression": "fp16"})
