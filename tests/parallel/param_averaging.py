"""A strategy distml does not ship, written as a new one would be: this file, and one line in
the registry (``STRATEGIES["param-avg"] = ParameterAveraging``).

Parameter averaging: every rank takes a plain local optimizer step on its own gradients, then
the ranks replace their parameters by the mean over ranks (one all-reduce). From identical
parameters, with plain SGD, the mean of the ranks' steps is the step on the mean gradient, so
it follows DDP's trajectory; with momentum or Adam it would not.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from distml.comm.collectives import ring_wire_bytes
from distml.parallel.strategy import StrategyEnv, TrainingStrategy


class ParameterAveraging(TrainingStrategy):
    def __init__(self, model: nn.Module, env: StrategyEnv):
        super().__init__(model, env)
        self.params = [p for p in model.parameters() if p.requires_grad]
        for p in self.params:  # start from rank 0's parameters
            dist.broadcast(p.data, 0)

    def step(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        super().step(optimizer, step)
        start = time.perf_counter()
        with torch.no_grad():
            flat = torch.cat([p.reshape(-1) for p in self.params])
            flat /= dist.get_world_size()
            dist.all_reduce(flat)
            offset = 0
            for p in self.params:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        nbytes = flat.numel() * flat.element_size()
        wire = ring_wire_bytes("all_reduce", nbytes, dist.get_world_size())
        self.env.recorder.add_comm("all_reduce", nbytes, wire)
        return time.perf_counter() - start
