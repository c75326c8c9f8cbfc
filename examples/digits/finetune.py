"""Fine-tune a trained digits classifier for a new task: is the digit even or odd?

    distml run --nproc 2 --run-name digits examples/digits/train.py --checkpoint-every 10
    distml run --nproc 2 --run-name parity examples/digits/finetune.py --base runs/digits/checkpoint
    distml run --nproc 2 examples/digits/finetune.py --base runs/digits/model.safetensors --lora 4
    python examples/digits/finetune.py --base runs/digits                      # one process

The base is any run's checkpoint (saved under any layout: it reshards) or its exported model.
The 10-class head becomes a 2-class one; the convolutions are frozen (``--freeze``), or, with
``--lora R``, the base is frozen whole and LoRA adapters train on its hidden Linear layer beside
the new head. The run folder gets the fine-tuned ``model.safetensors`` (adapters merged in) and,
with LoRA, the adapter alone in ``adapter.safetensors`` and ``adapter.json``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import distml
from distml.data import digits
from distml.models import DigitsCNN
from distml.train.checkpoint import load_weights
from distml.train.finetune import (
    add_lora,
    freeze,
    lora_config,
    merge_adapter,
    replace_head,
    save_adapter,
    trainable_parameters,
)


def parity(split: str) -> TensorDataset:
    """The digits, labelled 0 for even and 1 for odd."""
    x, y = digits(split).tensors
    return TensorDataset(x, y % 2)


def finetune(
    ctx: distml.Context,
    base: str,
    frozen: list[str],
    lora: int = 0,
    steps: int = 20,
    global_batch: int = 64,
    lr: float = 0.05,
) -> dict:
    model = DigitsCNN()
    load_weights(model, base)  # every rank reads the whole base
    replace_head(model, "head.3", 2)
    adapted = None
    if lora:
        adapted = add_lora(model, lora_config(model, lora, train=["head.3"]))
    else:
        freeze(model, frozen)
    optimizer = torch.optim.SGD(trainable_parameters(model), lr=lr, momentum=0.9)
    model, optimizer = ctx.setup(model, optimizer)
    loader = ctx.dataloader(parity("train"), batch_size=global_batch // ctx.data_world)
    while ctx.step < steps:
        for batch in loader:
            ctx.train_step(batch, loss=F.cross_entropy)
            if ctx.step == steps:
                break
    scores = ctx.evaluate(model, parity("val"))
    if adapted is not None:
        full = ctx.full_state_dict()  # rank 0: the whole adapted model, from every rank
        if full is not None:
            save_adapter(adapted, ctx.run_dir / "adapter.safetensors", full[0])
        merge_adapter(adapted)  # the export is then a plain DigitsCNN with a 2-class head
    return ctx.finish(eval=scores)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="run folder, checkpoint or .safetensors")
    parser.add_argument("--freeze", action="append", help="module pattern (default features.*)")
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank; 0: no adapters")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=64, help="split over the ranks")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()
    with distml.init() as ctx:
        finetune(
            ctx,
            args.base,
            args.freeze or ["features.*"],
            args.lora,
            args.steps,
            args.global_batch,
            args.lr,
        )


if __name__ == "__main__":
    main()
