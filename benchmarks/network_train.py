"""The GPT of examples/gpt under any strategy, with its validation loss every ``--eval-every``
steps written to ``curve.json`` in the run folder (benchmarks/network.py's training job).

    distml run --nproc 2 --strategy local-sgd:8 benchmarks/network_train.py --eval-every 8

Evaluate at multiples of H under Local SGD: the replicas are equal only right after they sync.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.utils.data import Subset

import distml
from distml.config import GPTConfig
from distml.data import stdlib_text
from distml.metrics import LM_METRICS
from distml.models import GPT, lm_loss


def train(ctx: distml.Context, steps: int, global_batch: int, lr: float, eval_every: int) -> dict:
    cfg = ctx.config.model or GPTConfig()
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model, optimizer = ctx.setup(model, optimizer)
    loader = ctx.dataloader(stdlib_text("train", cfg.seq_len), global_batch // ctx.data_world)
    val = Subset(stdlib_text("val", cfg.seq_len), range(256))
    curve = []
    while ctx.step < steps:
        for batch in loader:
            ctx.train_step(batch, loss=lm_loss)
            if eval_every and (ctx.step % eval_every == 0 or ctx.step == steps):
                loss = ctx.evaluate(model, val, LM_METRICS, batch_size=64)["loss"]
                curve.append((ctx.step, loss))
            if ctx.step == steps:
                break
    if ctx.rank == 0 and curve:
        (ctx.run_dir / "curve.json").write_text(json.dumps(curve))
    return ctx.finish()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-every", type=int, default=0, help="steps; 0: never")
    args = parser.parse_args()
    with distml.init() as ctx:
        train(ctx, args.steps, args.global_batch, args.lr, args.eval_every)


if __name__ == "__main__":
    main()
