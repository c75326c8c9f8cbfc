"""Oracle: N data-parallel workers with batch B = one process with batch N*B."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import distml
from conftest import rel_err
from distml.models import MLP

pytestmark = pytest.mark.distributed  # every test starts processes

STEPS = 20
BATCH = 8
SIZES = (16, 32, 10)


def dataset(n: int = 500) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    return TensorDataset(
        torch.randn(n, SIZES[0], generator=g), torch.randint(0, 10, (n,), generator=g)
    )


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def train_worker(ctx: distml.Context, steps: int, batch: int, momentum: float = 0.9) -> dict:
    model = MLP(SIZES)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    model, optimizer = ctx.setup(model, optimizer)
    loader = ctx.dataloader(dataset(), batch_size=batch)
    while ctx.step < steps:
        for x, y in loader:
            ctx.train_step((x, y), lambda b: F.cross_entropy(model(b[0]), b[1]))
            if ctx.step == steps:
                break
    summary = ctx.finish()
    # DDP wraps the model; a parameter-server worker trains the plain one.
    return {"params": flat_params(getattr(model, "module", model)), "summary": summary}


def single_process(steps: int, batch: int, momentum: float = 0.9) -> torch.Tensor:
    """The same training in one plain-torch process: seeded init, shuffled batches, SGD."""
    torch.manual_seed(0)
    model = MLP(SIZES)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    data = dataset()
    step, epoch = 0, 0
    while step < steps:
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(epoch))
        for start in range(0, len(data) - batch + 1, batch):
            x, y = data[order[start : start + batch]]
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            step += 1
            if step == steps:
                break
        epoch += 1
    return flat_params(model)


def launch_dp(tmp_path, name: str, nproc: int = 2, **strategy) -> dict:
    return distml.launch(
        train_worker,
        STEPS,
        BATCH,
        nproc=nproc,
        runs_dir=tmp_path,
        run_name=name,
        strategy=strategy,
        telemetry={"progress": False},
    )


@pytest.mark.parametrize("nproc", [2, 4])
def test_n_workers_batch_b_equal_one_process_batch_nb(nproc, tmp_path):
    out = launch_dp(tmp_path, "dp", nproc)
    expected = single_process(STEPS, nproc * BATCH)
    assert rel_err(out["params"], expected) <= 1e-5
    summary = out["summary"]
    assert summary["world_size"] == nproc and summary["steps"] == STEPS
    # Every step all-reduces every fp32 gradient once: 4 bytes per parameter.
    assert summary["comm_bytes"]["all_reduce"] == STEPS * 4 * expected.numel()
    # A ring all-reduce sends 2(N-1)/N of the payload from each rank.
    assert summary["wire_bytes"]["all_reduce"] == pytest.approx(
        STEPS * 4 * expected.numel() * 2 * (nproc - 1) / nproc, rel=1e-6
    )


def test_gradient_accumulation_equals_the_whole_batch(tmp_path):
    out = launch_dp(tmp_path, "accum", grad_accum=4)
    assert rel_err(out["params"], single_process(STEPS, 2 * BATCH)) <= 1e-5
    # Micro-batches under no_sync send nothing: still one all-reduce of the gradients per step.
    assert out["summary"]["comm_bytes"]["all_reduce"] == STEPS * 4 * out["params"].numel()


def test_fp16_compression_halves_the_payload_and_stays_close(tmp_path):
    out = launch_dp(tmp_path, "fp16", compression="fp16")
    numel = out["params"].numel()
    assert out["summary"]["comm_bytes"]["all_reduce"] == STEPS * 2 * numel
    assert rel_err(out["params"], single_process(STEPS, 2 * BATCH)) <= 1e-2


def test_powersgd_sends_low_rank_factors(tmp_path):
    out = launch_dp(
        tmp_path,
        "psgd",
        **{"compression": "powersgd", "powersgd_rank": 1, "powersgd_start_iter": 2},
    )
    # Two vanilla steps, then per step: the 32x16 and 10x32 weights as rank-1 factors
    # (32+16 and 10+32 elements), the biases (32 + 10) uncompressed.
    numel = out["params"].numel()
    compressed = (32 + 16) + (10 + 32) + 32 + 10
    expected = 2 * 4 * numel + (STEPS - 2) * 4 * compressed
    assert out["summary"]["comm_bytes"]["all_reduce"] == expected


def test_bf16_mixed_precision_trains_close_to_fp32(tmp_path):
    out = launch_dp(tmp_path, "bf16", mixed_precision="bf16")
    fp32 = single_process(STEPS, 2 * BATCH)
    # bf16 keeps 8 bits of mantissa: a few 1e-3 of drift over 20 steps, but the same training.
    assert 1e-6 < rel_err(out["params"], fp32) <= 5e-2
