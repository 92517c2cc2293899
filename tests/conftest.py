"""Session-wide settings for the tests (inherited by every rank and launcher they start)."""

import os

import pytest

# The tests' models are tiny, and by default weights that small keep autograd's path (the fused
# weight gradients, weight_grad.py, pay off on large weights only). The tests fuse every weight,
# so that the fused path is exercised together with every feature; test_weight_grad.py checks
# the default threshold itself.
os.environ.setdefault("SMSHIM_FUSED_WGRAD_MIN_NUMEL", "0")

# Checkpoints are signed with a per-user key created on first save in the user's config
# directory (checkpointing/signing.py): the tests use a throw-away one, never the developer's.
if "XDG_CONFIG_HOME" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _config_home = os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="smshim-tests-config-")
    _creator = os.getpid()

    def _remove_config_home() -> None:
        # Only in the process that made it: the test workers and the ranks they start inherit
        # the variable and use the same directory.
        if os.getpid() == _creator:
            shutil.rmtree(_config_home, ignore_errors=True)

    atexit.register(_remove_config_home)
os.environ.pop("SMSHIM_CHECKPOINT_KEY", None)

# Under PYTHONDONTWRITEBYTECODE (the development machine's shell sets it; a CI image may too) no
# process caches the bytecode of what it imports, and smshim is installed editable, so pip compiled
# none of it: every rank and launched worker the tests start would compile smshim's modules from
# source again, ~0.5 s of CPU each, 12 % of the suite's time (measured). Compile them once here;
# the flag only stops imports from writing bytecode, not from reading it.
import sys  # noqa: E402

if sys.dont_write_bytecode:
    import compileall
    from pathlib import Path

    import smshim

    # The package where it is installed; the tests' and examples' helpers in this checkout.
    _checkout = Path(__file__).resolve().parent.parent
    for _dir in (Path(smshim.__file__).resolve().parent, _checkout / "tests", _checkout / "examples"):
        if _dir.is_dir():
            compileall.compile_dir(_dir, quiet=1)

# The Hugging Face models the tests build: imported once, by the process that forks the ranks of
# `run_ranks`, instead of by every rank (~2.5 s of CPU each on a slow core; a fifth of the suite's
# time). Skipped where transformers is not installed.
from smshim.testing import preload  # noqa: E402

preload("transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2",
        "transformers.models.gpt_neox.modeling_gpt_neox", "transformers.models.bert.modeling_bert")

# ---- `-n auto` (pytest-xdist): how many test workers ----------------------------------------------
# One serial run keeps 2 cores only ~75 % busy (launchers, rendezvous, deliberate timeouts), so the
# README's command runs the suite on workers. One per core, but at most one per 4 GiB of memory
# (a worker's 8-rank test holds ~4 GiB) and at most 8. `-n 0` runs the tests one at a time.
_GIB_PER_WORKER = 4
_MAX_WORKERS = 8


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config) -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        mem_gib = _GIB_PER_WORKER * _MAX_WORKERS
    return max(1, min(cpus, int(mem_gib // _GIB_PER_WORKER), _MAX_WORKERS))


# ---- `-m "not slow"`: the quick part of the suite (single- and 2-process tests) ------------------
# Slow: tests that start more than 2 processes, a launcher (mpirun, torchrun, `smshim run`), an
# example script, or a sweep. A test whose own code calls `run_ranks(fn, N, ...)` with a literal
# N > 2 is found by itself; other such tests belong in one of the lists below.
import inspect  # noqa: E402
import re  # noqa: E402

SLOW_MODULES = {
    "test_examples.py", "test_restart.py", "test_gpt2_aws_style.py", "test_mpi_flavours.py",
    "test_huggingface.py", "test_tensor_parallel_hf.py", "test_random_models.py",
    "test_smp_topology.py", "test_smddp_backend.py", "test_gpt2_aws_script.py",
    "test_multinode.py", "test_first_hour.py", "test_hf_gpt2_smp.py", "test_tsm_fsdp.py",
    "test_tsm_checkpoint.py", "test_tsm_delayed.py", "test_tsm_example.py",
    "test_tsm_transform.py", "test_tsm_transform_api.py",
}
SLOW_TESTS = re.compile("|".join([
    r"mpirun", r"torchrun", r"smshim_run", r"launch", r"restart", r"processes",
    r"test_net_matches_single_process\[4-", r"\[4\]", r"\[4-", r"pp4", r"pp2_dp2", r"pp2_tp2",
    r"tp2_dp2", r"dp2", r"spec_table", r"permutations",
    r"test_launcher\.py::test_(modelparallel|dataparallel|plain|failing)",
]))


_MANY_RANKS = re.compile(r"run_ranks\(\s*[\w.]+\s*,\s*([3-9]|\d\d+)\b")


def _starts_many_ranks(item) -> bool:
    try:
        return bool(_MANY_RANKS.search(inspect.getsource(item.function)))
    except (OSError, TypeError):
        return False


def pytest_collection_modifyitems(config, items):
    for item in items:
        if (item.path.name in SLOW_MODULES or SLOW_TESTS.search(item.nodeid)
                or _starts_many_ranks(item)):
            item.add_marker(pytest.mark.slow)
