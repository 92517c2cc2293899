"""The `smdistributed` alias: every SPEC §0 module path resolves to smshim's module object."""

import importlib
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

PATHS = [
    "smdistributed.dataparallel.torch.distributed",
    "smdistributed.dataparallel.torch.parallel.distributed",
    "smdistributed.dataparallel.torch.parallel",
    "smdistributed.modelparallel.torch",
]


def _py(code: str, env=None, cwd=None) -> subprocess.CompletedProcess:
    full = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=full, cwd=cwd, timeout=120)


def test_find_spec_and_version():
    assert importlib.util.find_spec("smdistributed") is not None
    import smdistributed.modelparallel as mp

    assert isinstance(mp.__version__, str) and mp.__version__ >= "1.10"


@pytest.mark.parametrize("path", PATHS)
def test_alias_is_the_same_module(path):
    alias = importlib.import_module(path)
    real = importlib.import_module("smshim" + path[len("smdistributed"):])
    assert alias is real
    # The shared module keeps its own spec, so smshim.* stays importable and reloadable as itself.
    assert real.__spec__.name == real.__name__


def test_alias_in_a_fresh_interpreter():
    # What an unmodified script does, in a new process (the .pth hook must be active there).
    r = _py("""
        import importlib.util
        assert importlib.util.find_spec("smdistributed") is not None
        import smdistributed.dataparallel.torch.distributed as dist
        from smdistributed.dataparallel.torch.parallel.distributed import DistributedDataParallel
        import smdistributed.modelparallel.torch as smp
        import smshim.dataparallel.torch.distributed as ours
        assert dist is ours
        print("ok")
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_genuine_smdistributed_is_not_shadowed(tmp_path):
    fake = tmp_path / "smdistributed"
    fake.mkdir()
    (fake / "__init__.py").write_text("GENUINE = True\n")
    code = """
        import logging; logging.basicConfig()
        import smdistributed
        print("genuine" if getattr(smdistributed, "GENUINE", False) else "smshim")
    """
    r = _py(code, env={"PYTHONPATH": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "genuine"
    assert "does not shadow" in r.stderr  # said out loud, not silently
    forced = _py(code, env={"PYTHONPATH": str(tmp_path), "SMSHIM_ALIAS": "force"})
    assert forced.stdout.strip() == "smshim", forced.stderr


def test_alias_can_be_turned_off():
    r = _py("import smdistributed", env={"SMSHIM_ALIAS": "0"})
    assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr
