"""Worker of the shard benchmark: a wide MLP (6.3 M parameters, 25 MB of gradients) on tiny
batches, so that a step's time is the server's (receive, apply, send), not the worker's."""

import argparse

import torch
import torch.nn.functional as F

import distml
from distml.models import MLP

parser = argparse.ArgumentParser()
parser.add_argument("steps", type=int)
args = parser.parse_args()

with distml.init() as ctx:
    model = MLP((512, 2048, 2048, 512, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = ctx.setup(model, optimizer)
    g = torch.Generator().manual_seed(ctx.rank)
    x, y = torch.randn(4, 512, generator=g), torch.randint(0, 10, (4,), generator=g)
    while ctx.step < args.steps:
        ctx.train_step((x, y), lambda b: F.cross_entropy(model(b[0]), b[1]))
    ctx.finish()
