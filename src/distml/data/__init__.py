"""Sharded, resumable data loading and bundled datasets."""

from distml.data.datasets import digits
from distml.data.loader import ShardedLoader
from distml.data.sampler import ShardedBatchSampler, eval_shard
from distml.data.text import stdlib_text

__all__ = ["digits", "ShardedLoader", "ShardedBatchSampler", "eval_shard", "stdlib_text"]
