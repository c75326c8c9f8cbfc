"""Distributed validation equals single-process evaluation, with sizes that do not divide."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import distml
from distml.data import eval_shard
from distml.models import MLP


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(
        torch.randn(101, 16, generator=g), torch.randint(0, 10, (101,), generator=g)
    )


def margin(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A custom metric: the target logit minus the largest other logit."""
    target_logit = output.gather(1, target[:, None]).squeeze(1)
    others = output.scatter(1, target[:, None], float("-inf")).max(dim=1).values
    return target_logit - others


def eval_worker(ctx: distml.Context) -> dict:
    torch.manual_seed(3)
    model = MLP((16, 32, 10))
    metrics = {
        "accuracy": distml.metrics.accuracy,
        "loss": distml.metrics.cross_entropy,
        "margin": margin,
    }
    return ctx.evaluate(model, dataset(), metrics, batch_size=7)


@pytest.mark.distributed
@pytest.mark.parametrize("nproc", [2, 4])
def test_distributed_evaluation_equals_one_process(nproc, tmp_path):
    result = distml.launch(eval_worker, nproc=nproc, runs_dir=tmp_path, run_name="eval")
    torch.manual_seed(3)
    model = MLP((16, 32, 10))
    x, y = dataset().tensors
    with torch.no_grad():
        out = model(x)
    assert result["samples"] == 101
    assert result["accuracy"] == pytest.approx(
        (out.argmax(1) == y).double().mean().item(), abs=1e-12
    )
    assert result["loss"] == pytest.approx(F.cross_entropy(out, y).item(), rel=1e-6)
    assert result["margin"] == pytest.approx(margin(out, y).double().mean().item(), rel=1e-6)


@pytest.mark.parametrize("n,world", [(101, 4), (7, 3), (2, 4), (100, 1)])
def test_eval_shards_cover_every_sample_once(n, world):
    covered = [i for r in range(world) for i in eval_shard(range(n), r, world)]
    assert covered == list(range(n))
