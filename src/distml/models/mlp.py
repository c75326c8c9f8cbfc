"""A multilayer perceptron. Plain PyTorch."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """``sizes=(64, 128, 10)``: Linear(64,128) -> ReLU -> Linear(128,10).

    >>> MLP((64, 32, 10))(torch.zeros(2, 64)).shape
    torch.Size([2, 10])
    """

    def __init__(self, sizes: tuple[int, ...] = (64, 128, 10)):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            layers.append(nn.Linear(a, b))
            if i < len(sizes) - 2:
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
