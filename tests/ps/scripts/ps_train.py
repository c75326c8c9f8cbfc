"""A parameter-server worker script for the fault tests.

    distml run --strategy ps ... ps_train.py STEPS [--delay S] [--kill RANK:STEP]

Trains an MLP on synthetic data for STEPS steps per worker, sleeping DELAY seconds a step. With
``--kill RANK:STEP`` that rank SIGKILLs itself before step STEP on its first attempt (a real
crash: no push, no goodbye).
"""

import argparse
import os
import signal
import time

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import distml
from distml.models import MLP

parser = argparse.ArgumentParser()
parser.add_argument("steps", type=int)
parser.add_argument("--delay", type=float, default=0.0)
parser.add_argument("--kill", default=None)
args = parser.parse_args()

g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(4096, 16, generator=g), torch.randint(0, 4, (4096,), generator=g))
kill_rank, kill_step = map(int, args.kill.split(":")) if args.kill else (-1, -1)

with distml.init() as ctx:
    model = MLP((16, 32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = ctx.setup(model, optimizer)
    loader = ctx.dataloader(data, batch_size=16)
    ctx.load_checkpoint()  # a restarted worker resumes at its clock on the servers
    while ctx.step < args.steps:
        for x, y in loader:
            if ctx.rank == kill_rank and ctx.step == kill_step and ctx.attempt == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(args.delay)
            ctx.train_step((x, y), lambda b: F.cross_entropy(model(b[0]), b[1]))
            if ctx.step == args.steps:
                break
    ctx.finish()
