"""The data-parallel oracle the tests share: an MLP trained by N workers of ``distml`` and the
same training in one plain-torch process."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import distml
from distml.models import MLP

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
    plain = getattr(model, "module", model)
    return {"params": flat_params(plain), "summary": summary, "wrapper": type(model).__name__}


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
