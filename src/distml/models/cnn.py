"""A small convolutional classifier for 8x8 digit images. Plain PyTorch."""

from __future__ import annotations

import torch
from torch import nn


class DigitsCNN(nn.Module):
    """conv(1->c) -> conv(c->2c) -> pool -> linear(hidden) -> linear(10).

    >>> DigitsCNN()(torch.zeros(4, 1, 8, 8)).shape
    torch.Size([4, 10])
    """

    def __init__(self, channels: int = 16, hidden: int = 64, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(2 * channels * 4 * 4, hidden),
            nn.ReLU(),
            nn.Linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))
