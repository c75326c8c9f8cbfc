"""Parameter servers: shards that hold the parameters and apply the optimizer, workers that
push gradients and pull parameters, under BSP, ASP or SSP consistency."""

from distml.ps.placement import place_parameters
from distml.ps.shard import ParameterShard, ShardSettings

__all__ = ["ParameterShard", "ShardSettings", "place_parameters"]
