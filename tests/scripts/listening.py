"""Run by tests/test_runtime.py under `smshim run` or mpirun: rank 0 prints every TCP socket that
the job's processes listen on (its launcher too, under `smshim run`), one `LISTEN addr:port pid`
line each, after the default group is up and smp-style subgroups exist."""

import os
import subprocess

import torch
import torch.distributed as dist

import smdistributed.dataparallel.torch.distributed as sdist

sdist.init_process_group()
sub = dist.new_group(backend="gloo")  # e.g. the pipeline transport's dedicated gloo group
t = torch.ones(1)
dist.all_reduce(t, group=sub)
pids = [None] * dist.get_world_size()
dist.all_gather_object(pids, os.getpid())
if dist.get_rank() == 0:
    watched = set(pids) | ({os.getppid()} if os.environ.get("TORCHELASTIC_RUN_ID") else set())
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        for pid in watched:
            if f"pid={pid}," in line:
                print(f"LISTEN {line.split()[3]} {pid}", flush=True)
    print(f"STORE {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} "
          f"GLOO_SOCKET_IFNAME={os.environ.get('GLOO_SOCKET_IFNAME')}", flush=True)
dist.barrier()
