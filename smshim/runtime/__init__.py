"""The process: how it was launched (torchrun, Open MPI, MPICH, SageMaker, plain), its rank and
world, and the default torch.distributed process group (`launch.py`).

Shared by data parallel, model parallel v1 and v2. Imports torch only (and, under mpirun, mpi4py).
"""
