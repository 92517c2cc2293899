"""SMP v1 sharded data parallelism (`sharded_data_parallel_degree > 1`) on torch's FSDP.

Holds the FSDP wrapping of a `DistributedModel`'s module, its (shard, replicate) process groups,
the exact global gradient norm over shards, and the sharded / gathered state dicts that
`smp.save_checkpoint` writes. May import the model-parallel ground (errors, config, topology,
state) and torch; the API (model.py, optimizer.py) and checkpointing call into it.
"""
