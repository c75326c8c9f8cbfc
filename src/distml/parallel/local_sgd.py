"""Local SGD and DiLoCo: workers train alone for H steps, then average what they learned.

Every ``sync_every`` (H) optimizer steps, each worker's *pseudo-gradient* -- the global parameters
minus its local ones -- is averaged with one all-reduce and applied to the global parameters by an
outer optimizer; the result becomes every worker's new starting point. With an outer SGD of
learning rate 1 and no momentum this is plain model averaging (Local SGD: Stich 2019, Lin et al.
2020); with Nesterov momentum it is DiLoCo (Douillard et al. 2023, who use lr 0.7, momentum 0.9).
The inner optimizer and its state stay local. Communication falls by a factor H against
all-reducing gradients every step.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from distml.comm.collectives import ring_wire_bytes
from distml.parallel.strategy import StrategyEnv, TrainingStrategy


class LocalSGD(TrainingStrategy):
    """No per-step communication: each rank steps alone, and every H steps the ranks sync."""

    def __init__(self, model: nn.Module, env: StrategyEnv):
        super().__init__(model, env)
        cfg = env.config.strategy
        self.every = cfg.sync_every
        self.params = [p for p in model.parameters() if p.requires_grad]
        for p in self.params:  # start from rank 0's parameters, whatever each rank initialised
            dist.broadcast(p.data, 0)
        self.global_params = [p.detach().clone() for p in self.params]
        self.outer = torch.optim.SGD(
            self.global_params,
            lr=cfg.outer_lr,
            momentum=cfg.outer_momentum,
            nesterov=cfg.outer_momentum > 0,
        )
        self.world = dist.get_world_size()
        self.steps = 0

    def step(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        """The inner step; every H of them, the sync. Returns the seconds spent synchronising."""
        super().step(optimizer, step)
        self.steps += 1
        if self.steps % self.every:
            return 0.0
        return self.sync()

    def sync(self) -> float:
        """Average the pseudo-gradients, apply them with the outer optimizer, and start every
        rank from the result. Returns the seconds spent."""
        start = time.perf_counter()
        with torch.no_grad():
            deltas = [g - p for g, p in zip(self.global_params, self.params, strict=True)]
            flat = torch.cat([d.reshape(-1) for d in deltas])
            flat /= self.world
            dist.all_reduce(flat)
            offset = 0
            for g, d in zip(self.global_params, deltas, strict=True):
                g.grad = flat[offset : offset + d.numel()].view_as(d)
                offset += d.numel()
            self.outer.step()
            self.outer.zero_grad(set_to_none=True)
            for g, p in zip(self.global_params, self.params, strict=True):
                p.copy_(g)
        nbytes = flat.numel() * flat.element_size()
        self.env.recorder.add_comm(
            "all_reduce", nbytes, ring_wire_bytes("all_reduce", nbytes, self.world)
        )
        return time.perf_counter() - start
