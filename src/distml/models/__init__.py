"""Reference models: plain PyTorch, with no parallel code inside."""

from distml.models.cnn import DigitsCNN
from distml.models.gpt import GPT, generate, lm_loss
from distml.models.mlp import MLP

__all__ = ["GPT", "DigitsCNN", "MLP", "generate", "lm_loss"]
