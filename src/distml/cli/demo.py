"""``distml demo``: the main job on the embedded default, local CPU worker processes."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from distml.config import RunConfig
from distml.data import digits
from distml.launch.api import launch
from distml.models import DigitsCNN
from distml.runtime.context import Context


def train_digits(ctx: Context, epochs: int, batch_size: int = 32, lr: float = 0.05) -> dict:
    """Data-parallel SGD on the digits, a checkpoint per epoch, validation, summary."""
    model = DigitsCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    model, optimizer = ctx.setup(model, optimizer)
    loader = ctx.dataloader(digits("train"), batch_size=batch_size)
    ctx.load_checkpoint()
    while loader.epoch < epochs:
        for x, y in loader:
            ctx.train_step((x, y), lambda b: F.cross_entropy(model(b[0]), b[1]))
        ctx.save_checkpoint()
    return ctx.finish(eval=ctx.evaluate(model, digits("val")))


def run_demo(config: RunConfig, epochs: int) -> dict[str, Any]:
    return launch(train_digits, epochs, config=config)
