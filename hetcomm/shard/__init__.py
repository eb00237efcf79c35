"""Sharded training state: each rank owns one contiguous range of the flat parameter
space, sized by its memory, and keeps the fp32 masters and AdamW moments of that range
only, and with Shard(weights=True) its range of the weights too, each layer's weights
gathered while the layer computes (between hetcomm.comm, which it uses, and the
training loop, which uses it)."""

from hetcomm.shard.flat import FlatParameters
from hetcomm.shard.layout import ShardLayout, layout_by_memory, layout_from_sizes
from hetcomm.shard.optimizer import ShardedAdamW
from hetcomm.shard.reducer import ShardedReducer
from hetcomm.shard.spec import Shard
from hetcomm.shard.weights import ShardedWeights

__all__ = ["FlatParameters", "Shard", "ShardLayout", "ShardedAdamW", "ShardedReducer", "ShardedWeights",
           "layout_by_memory", "layout_from_sizes"]
