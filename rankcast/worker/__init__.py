"""Worker ranks: each owns a device, its model shard, its KV cache and its sampler."""
