"""The process: how it was launched (torchrun, Open MPI, MPICH, SageMaker, plain), its rank and
world, and the default torch.distributed process group (`launch.py`); the opt-in CPU mode that
runs a GPU script's device lines on the CPU (`cpu_mode.py`, SMSHIM_CPU=1); the threads'
scheduling class and, on a CPU-only host, the rank's cores while a pipeline runs
(`scheduling.py`, SMSHIM_SCHED_BATCH, SMSHIM_BIND_CORES).

Shared by data parallel, model parallel v1 and v2. Imports torch only (and, under mpirun, mpi4py).
"""
