"""Data-parallel training of a CNN on scikit-learn's digits: a torchrun-style script.

    distml run --nproc 2 examples/digits/train.py --epochs 5
    distml run --nproc 2 --strategy ddp:compression=fp16 examples/digits/train.py
    distml run --nproc 4 --strategy ps --consistency ssp:2 examples/digits/train.py
    torchrun --nproc-per-node 2 examples/digits/train.py       # the same script, plain torchrun
    python examples/digits/train.py                           # one process

Strategy options come from ``distml run`` (``--strategy``, ``--mesh``...) through the run config;
the script itself only says what to train. It resumes from its run's latest checkpoint, so a
restarted worker (``--max-restarts``) carries on where the job stopped.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import distml
from distml.data import digits
from distml.models import DigitsCNN


def train(
    ctx: distml.Context,
    epochs: int = 5,
    max_steps: int = 0,
    batch_size: int = 32,
    lr: float = 0.05,
    checkpoint_every: int = 0,
) -> dict:
    model = DigitsCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    model, optimizer = ctx.setup(model, optimizer)
    loader = ctx.dataloader(digits("train"), batch_size=batch_size)
    ctx.load_checkpoint()  # no-op on a fresh run

    def loss_of(batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    done = False
    while not done and loader.epoch < epochs:
        for batch in loader:
            ctx.train_step(batch, loss_of)
            if checkpoint_every and ctx.step % checkpoint_every == 0:
                ctx.save_checkpoint()
            done = ctx.step == max_steps
            if done:
                break
    return ctx.finish(eval=ctx.evaluate(model, digits("val")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--max-steps", type=int, default=0, help="stop after this many steps")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--checkpoint-every", type=int, default=0, help="steps; 0: never")
    args = parser.parse_args()
    with distml.init() as ctx:
        train(ctx, args.epochs, args.max_steps, args.batch_size, args.lr, args.checkpoint_every)


if __name__ == "__main__":
    main()
