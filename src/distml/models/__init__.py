"""Reference models: plain PyTorch, with no parallel code inside."""

from distml.models.cnn import DigitsCNN
from distml.models.mlp import MLP

__all__ = ["DigitsCNN", "MLP"]
