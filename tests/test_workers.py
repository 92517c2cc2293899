"""smshim's own threads compute with the process's intra-op thread count (workers.py)."""

import os
import sys
import textwrap

import pytest

from smshim.testing import run_command

# A script that sets one intra-op thread the way training scripts do (torch.set_num_threads,
# not OMP_NUM_THREADS), then runs a matrix product on a fresh thread of each kind smshim starts,
# and prints how many OS threads appeared during the product: an OpenMP team of the default size
# (one thread per core) starts some; one thread starts none.
_SCRIPT = textwrap.dedent("""
    import os, threading
    from concurrent.futures import ThreadPoolExecutor
    import torch
    from smshim.modelparallel.torch.pipeline.workers import Workers, adopt_intra_op_threads

    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    (a @ a).sum()  # the main thread's team, before counting

    def tasks():
        return set(os.listdir("/proc/self/task"))

    def product(out):
        before = tasks()
        (a @ a).sum()
        out.append(len(tasks() - before))  # (threads that end meanwhile do not count)

    started = {}
    out = []
    t = threading.Thread(target=product, args=(out,))
    t.start(); t.join()
    started["plain thread"] = out[0]
    out = []
    done = threading.Event()
    workers = Workers("probe")
    workers.run(lambda: (product(out), done.set()))
    done.wait(60)
    started["Workers"] = out[0]
    out = []
    with ThreadPoolExecutor(1, initializer=adopt_intra_op_threads) as pool:
        pool.submit(product, out).result(60)
    started["pool"] = out[0]
    workers.stop()
    print("STARTED", started)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux") or (os.cpu_count() or 1) < 2,
                    reason="counts threads in /proc; needs an OpenMP default of 2+ threads")
def test_smshims_threads_compute_with_the_processs_thread_count():
    out = run_command([sys.executable, "-c", _SCRIPT], timeout=120,
                      env={"OMP_NUM_THREADS": None, "MKL_NUM_THREADS": None}).stdout
    started = eval(out.split("STARTED", 1)[1].strip())
    # The control: a thread that nobody set up gets the OpenMP default, else this machine cannot
    # show the difference.
    if started["plain thread"] == 0:
        pytest.skip("this torch build starts no OpenMP team in a fresh thread")
    assert started["Workers"] == 0 and started["pool"] == 0, started
