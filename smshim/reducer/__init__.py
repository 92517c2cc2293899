"""The gradient reducer: bucketed, overlapped all-reduce of gradients over a process group
(`grad_reducer.py`), used by smddp's DistributedDataParallel and by smp's data-parallel dimension.

Imports torch only.
"""
