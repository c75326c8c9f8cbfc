"""Per-sample metrics for :meth:`distml.Context.evaluate`."""

from distml.train.evaluate import METRICS, accuracy, cross_entropy

__all__ = ["METRICS", "accuracy", "cross_entropy"]
