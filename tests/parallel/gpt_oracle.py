"""One GPT training, run under any layout and in one plain process, for the oracles."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

import distml
from distml.config import GPTConfig
from distml.data import ShardedBatchSampler, stdlib_text
from distml.models import GPT, lm_loss

CFG = GPTConfig(vocab_size=256, seq_len=16, layers=4, hidden=32, heads=4)
BATCH = 8  # per data-parallel rank
STEPS = 5
LR = 0.1


def corpus():
    return stdlib_text("train", seq_len=CFG.seq_len, max_bytes=60_000)


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps the full gradients of the step after ``record_next`` is set (gathering
    sharded ones is a collective: only then, so that other steps' traffic is the layout's)."""

    record_next = False

    def step(self, closure=None):  # noqa: ANN001
        if self.record_next:
            self.last_grads = [
                (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
                for group in self.param_groups
                for p in group["params"]
            ]
        return super().step(closure)


def train(ctx: distml.Context, out_dir: str, steps: int = STEPS, batch: int = BATCH) -> dict:
    model = GPT(ctx.config.model or CFG)
    optimizer = RecordingSGD(model.parameters(), lr=LR, momentum=0.9)
    model, optimizer = ctx.setup(model, optimizer)
    loader = ctx.dataloader(corpus(), batch_size=batch)
    losses = []
    for x, y in loader:
        optimizer.record_next = ctx.step == steps - 1
        losses.append(ctx.train_step((x, y), loss=lm_loss))
        if ctx.step == steps:
            break
    # Each rank's loss is its own batch's; the mean over the world is the global batch's (ranks
    # of one tensor or pipeline group repeat the same value equally often).
    mean = torch.tensor(losses, dtype=torch.float64)
    torch.distributed.all_reduce(mean)
    losses = (mean / ctx.world_size).tolist()
    from distml.parallel.layout import parameter_names  # torch's pipelining: slow to import

    names = {id(p): n for n, p in parameter_names(ctx.model).items()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    grads = {names[id(p)]: g for p, g in zip(params, optimizer.last_grads, strict=True)}
    save_file(grads, str(Path(out_dir) / f"grads_rank{ctx.rank}.safetensors"))
    summary = ctx.finish()
    return {"losses": losses, "summary": summary}


def single_process(steps: int = STEPS, batch: int = BATCH, cfg: GPTConfig = CFG) -> dict:
    """The same training in one plain-torch process."""
    torch.manual_seed(0)
    model = GPT(cfg)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    data = corpus()
    losses = []
    for idx in ShardedBatchSampler(len(data), batch, 0, 1, seed=0):
        x, y = data[idx]
        optimizer.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        optimizer.step()
        losses.append(loss.item())
        if len(losses) == steps:
            break
    return {"losses": losses, "grads": grads, "params": dict(model.named_parameters())}


def gathered_grads(out_dir: Path) -> dict[str, torch.Tensor]:
    grads: dict[str, torch.Tensor] = {}
    for path in sorted(Path(out_dir).glob("grads_rank*.safetensors")):
        grads.update(load_file(str(path)))
    return grads


def exported(summary: dict) -> dict[str, torch.Tensor]:
    return load_file(summary["export"])
