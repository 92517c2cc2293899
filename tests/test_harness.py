"""The harness itself: a failing, dying or hanging rank fails the test, with the rank's traceback."""

import os
import sys
import time

import pytest

import smshim.testing
from smshim.testing import RankFailure, preload, run_command, run_ranks


def _returns_rank():
    return int(os.environ["RANK"]) * 10


def _rank1_raises():
    if os.environ["RANK"] == "1":
        raise ValueError("boom from rank one")
    return "fine"


def _rank0_hangs():
    if os.environ["RANK"] == "0":
        time.sleep(600)
    return "fine"


def _rank1_dies():
    if os.environ["RANK"] == "1":
        os._exit(7)
    time.sleep(600)


def _collective_with_dead_peer():
    # Rank 1 raises before the collective; rank 0 blocks in it. The harness must not wait.
    import torch
    import torch.distributed as dist
    from smshim.runtime import launch as _runtime

    _runtime.init_distributed()
    if dist.get_rank() == 1:
        raise RuntimeError("rank one gives up before all_reduce")
    dist.all_reduce(torch.ones(1))


def _master_port_taken_then_rendezvous():
    """Can another socket bind MASTER_PORT before the group comes up? Then a collective."""
    import socket

    import torch
    import torch.distributed as dist
    from smshim.runtime import launch as _runtime

    taken = None
    if sys.platform.startswith("linux") and os.environ["RANK"] == "0":
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", int(os.environ["MASTER_PORT"])))
                taken = False
            except OSError:
                taken = True
    _runtime.init_distributed()
    t = torch.ones(1)
    dist.all_reduce(t)
    return taken, t.item()


def test_the_master_port_is_held_for_the_ranks_until_rank_0_binds_it():
    """No other socket can take the ranks' MASTER_PORT between the harness choosing it and rank
    0's store binding it (a port that `free_port` said was free, taken meanwhile by another
    test's listener, failed rank 0 with "address already in use"); the store still binds."""
    results = run_ranks(_master_port_taken_then_rendezvous, 2, timeout=60)
    assert [total for _, total in results] == [2.0, 2.0], results
    if sys.platform.startswith("linux"):
        assert results[0][0] is True, results


def test_results_in_rank_order():
    assert run_ranks(_returns_rank, 3, timeout=60) == [0, 10, 20]


def test_raising_rank_fails_with_its_traceback():
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as e:
        run_ranks(_rank1_raises, 2, timeout=60)
    assert "rank 1 of 2 failed" in str(e.value)
    assert "ValueError: boom from rank one" in str(e.value)
    assert "_rank1_raises" in str(e.value)  # the traceback, not just the message
    assert time.monotonic() - t0 < 30


def test_hanging_rank_times_out():
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"ranks \[0\] did not finish within 5 s"):
        run_ranks(_rank0_hangs, 2, timeout=5)
    assert time.monotonic() - t0 < 20


def test_dying_rank_fails_the_test():
    with pytest.raises(RankFailure, match="rank 1 died with exit code 7"):
        run_ranks(_rank1_dies, 2, timeout=60)


def test_peer_stuck_in_collective_does_not_hang():
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="rank one gives up"):
        run_ranks(_collective_with_dead_peer, 2, timeout=60)
    assert time.monotonic() - t0 < 30


def test_run_command_timeout_kills_the_group():
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="did not finish within 2 s"):
        run_command(["bash", "-c", "sleep 100 & sleep 100"], timeout=2)
    assert time.monotonic() - t0 < 10


def _imported(name):
    import sys

    return name in sys.modules


def test_a_preloaded_module_is_imported_when_a_rank_starts():
    # conftest.py preloads Hugging Face's GPT-2 model; json.tool is imported by nothing else.
    pytest.importorskip("transformers")
    assert run_ranks(_imported, 2, "transformers.models.gpt2.modeling_gpt2") == [True, True]
    assert run_ranks(_imported, 1, "json.tool") == [False]


def _inherited_frozen_and_own_garbage_collected():
    import gc
    import weakref

    import torch

    class Node:
        pass

    a, b = Node(), Node()
    a.peer, b.peer = b, a  # a reference cycle: only the collector frees it
    gone = weakref.ref(a)
    del a, b
    gc.collect()
    frozen = gc.get_freeze_count()
    # torch's modules (imported by the forkserver, before the fork) are among the frozen objects.
    return frozen, gone() is None, any(o is torch.nn.Module for o in gc.get_objects())


def test_a_rank_freezes_what_it_inherited_and_collects_its_own_garbage():
    # Each rank hands the forkserver's objects (torch, Hugging Face's models: ~300,000) to the
    # collector's permanent generation, so smp's exit teardown's full collection does not walk and
    # copy them (~0.2 s of CPU per rank); what the rank makes itself is still collected.
    frozen, collected, torch_tracked = run_ranks(_inherited_frozen_and_own_garbage_collected, 1)[0]
    assert frozen > 100_000, frozen
    assert collected
    assert not torch_tracked  # gc.get_objects() leaves out the permanent generation


def test_preload_after_the_first_run_ranks_says_so():
    run_ranks(_returns_rank, 1)
    with pytest.raises(RuntimeError, match="before the first run_ranks"):
        preload("json.tool")
    assert "json.tool" not in smshim.testing._PRELOAD


@pytest.mark.parametrize("cpus, mem_gib, workers", [(2, 24, 2), (64, 24, 6), (64, 512, 8), (4, 3, 1)])
def test_auto_workers_are_capped_by_cores_memory_and_eight(monkeypatch, cpus, mem_gib, workers):
    from tests import conftest

    page = 4096
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    monkeypatch.setattr(os, "sysconf", lambda name: page if name == "SC_PAGE_SIZE"
                        else mem_gib * 2**30 // page)
    assert conftest.pytest_xdist_auto_num_workers(None) == workers


def test_smshim_modules_have_bytecode_even_under_dont_write_bytecode():
    # The ranks and workers the tests start read smshim's bytecode instead of compiling it each
    # (conftest.py compiles it when PYTHONDONTWRITEBYTECODE keeps imports from doing so).
    import importlib.util
    import sys

    files = [m.__file__ for name, m in list(sys.modules.items())
             if name.split(".")[0] == "smshim" and getattr(m, "__file__", None)
             and m.__file__.endswith(".py")]
    assert files
    missing = [f for f in files if not os.path.exists(importlib.util.cache_from_source(f))]
    assert not missing, f"no bytecode for {missing[:3]} (dont_write_bytecode={sys.dont_write_bytecode})"
