"""Per-sample metrics for :meth:`distml.Context.evaluate`."""

from distml.train.evaluate import (
    LM_METRICS,
    METRICS,
    accuracy,
    cross_entropy,
    token_accuracy,
    token_loss,
)

__all__ = ["LM_METRICS", "METRICS", "accuracy", "cross_entropy", "token_accuracy", "token_loss"]
