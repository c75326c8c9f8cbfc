"""A parameter-server worker script that records which samples it trained on.

    distml run --strategy ps ... ps_claims.py EPOCHS OUT [--slow RANK:SECONDS]

Trains an MLP on 640 synthetic samples for EPOCHS epochs, batch 16; rank RANK sleeps SECONDS a
step. Each rank writes the indices of its samples, epoch by epoch, to OUT/rank{R}.json.
"""

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import distml
from distml.models import MLP

parser = argparse.ArgumentParser()
parser.add_argument("epochs", type=int)
parser.add_argument("out", type=Path)
parser.add_argument("--slow", default="-1:0")
args = parser.parse_args()
slow_rank, delay = args.slow.split(":")

g = torch.Generator().manual_seed(0)
n = 640
data = TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g))
data = TensorDataset(*data.tensors, torch.arange(n))

with distml.init() as ctx:
    model = MLP((16, 32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = ctx.setup(model, optimizer)
    loader = ctx.dataloader(data, batch_size=16)
    seen: list[list[int]] = []
    while loader.epoch < args.epochs:
        seen.append([])
        for x, y, index in loader:
            if ctx.rank == int(slow_rank):
                time.sleep(float(delay))
            ctx.train_step((x, y), lambda b: F.cross_entropy(model(b[0]), b[1]))
            seen[-1] += index.tolist()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{ctx.rank}.json").write_text(json.dumps(seen))
    ctx.finish()
