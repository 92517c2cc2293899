"""Tensor parallelism: the collectives (`collectives.py`, safe under the pipeline's concurrent
microbatches), how parameters are split and gathered (`shard.py`), the distributed modules
behind `smp.nn` (`nn/`), and which modules get replaced by them (`replace.py`).

May import the face's ground modules (`..errors`, `..state`, `..comm`) and the engine's thread
context (`..pipeline.context`); never the API, `..checkpointing` or `..precision`.
"""
