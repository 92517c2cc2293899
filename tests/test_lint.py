"""`ruff check` passes with the project's rule set (pyproject.toml, [tool.ruff.lint])."""

import os
import subprocess

import pytest

from smshim.testing import find_executable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ruff_passes():
    ruff = find_executable("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    r = subprocess.run([ruff, "check", "--no-cache", ROOT], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
