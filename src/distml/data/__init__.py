"""Sharded, resumable data loading, bundled datasets, and distributed preprocessing.

Names are imported on first use (PEP 562): a preprocessing worker needs none of the torch-based
loaders.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distml._lazy import lazy_getattr

if TYPE_CHECKING:
    from distml.data.datasets import digits
    from distml.data.loader import ShardedLoader
    from distml.data.sampler import ClaimedBatchSampler, ShardedBatchSampler, eval_shard
    from distml.data.text import stdlib_text

__getattr__ = lazy_getattr(
    "distml.data",
    {
        "digits": "distml.data.datasets:digits",
        "ShardedLoader": "distml.data.loader:ShardedLoader",
        "ShardedBatchSampler": "distml.data.sampler:ShardedBatchSampler",
        "ClaimedBatchSampler": "distml.data.sampler:ClaimedBatchSampler",
        "eval_shard": "distml.data.sampler:eval_shard",
        "stdlib_text": "distml.data.text:stdlib_text",
    },
)

__all__ = [
    "digits",
    "ShardedLoader",
    "ShardedBatchSampler",
    "ClaimedBatchSampler",
    "eval_shard",
    "stdlib_text",
]
