"""A GPT on the Python standard library's source, byte by byte, under any parallel layout.

    distml run --nproc 2 --mesh tp=2 examples/gpt/train.py --steps 20
    distml run --nproc 2 --mesh pp=2 --schedule 1f1b --microbatches 4 examples/gpt/train.py
    distml run --nproc 4 --mesh fsdp=2,tp=2 examples/gpt/train.py
    distml run --nproc 8 --mesh dp=2,tp=2,pp=2 examples/gpt/train.py
    python examples/gpt/train.py --steps 20                   # one process: the same parameters

The model's size comes from the run config (``distml run --model layers=4,hidden=128,...``), the
layout from ``--mesh``; the script only says what to train. ``--global-batch`` is the batch of a
whole step, split over the data-parallel ranks, so every layout takes the same steps as one
process.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import Subset

import distml
from distml.config import GPTConfig
from distml.data import stdlib_text
from distml.metrics import LM_METRICS
from distml.models import GPT, lm_loss


def train(
    ctx: distml.Context,
    steps: int = 20,
    global_batch: int = 16,
    lr: float = 3e-3,
    val_samples: int = 256,
    checkpoint_every: int = 0,
) -> dict:
    cfg = ctx.config.model or GPTConfig()
    if global_batch % ctx.data_world:
        raise SystemExit(
            f"--global-batch {global_batch} does not split over {ctx.data_world} "
            "data-parallel ranks"
        )
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model, optimizer = ctx.setup(model, optimizer)
    loader = ctx.dataloader(stdlib_text("train", cfg.seq_len), global_batch // ctx.data_world)
    ctx.load_checkpoint()  # no-op on a fresh run
    while ctx.step < steps:
        for batch in loader:
            ctx.train_step(batch, loss=lm_loss)
            if checkpoint_every and ctx.step % checkpoint_every == 0:
                ctx.save_checkpoint()
            if ctx.step == steps:
                break
    val = stdlib_text("val", cfg.seq_len)
    val = Subset(val, range(min(val_samples, len(val))))
    return ctx.finish(eval=ctx.evaluate(model, val, LM_METRICS, batch_size=64))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=16, help="samples per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--val-samples", type=int, default=256)
    parser.add_argument("--checkpoint-every", type=int, default=0, help="steps; 0: never")
    args = parser.parse_args()
    with distml.init() as ctx:
        train(ctx, args.steps, args.global_batch, args.lr, args.val_samples, args.checkpoint_every)


if __name__ == "__main__":
    main()
