"""The README's two fresh-machine commands and CI stay in step."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme_commands():
    text = open(os.path.join(ROOT, "README.md")).read()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    return [b.strip() for b in blocks[:2]]


def test_ci_runs_the_readme_test_command():
    """CI runs the README's test command verbatim, in a fresh venv it creates and activates first
    (so a step that works only with packages already on the machine fails in CI too)."""
    run_cmd, test_cmd = _readme_commands()
    lines = [ln.strip() for ln in open(os.path.join(ROOT, ".ci", "run")).read().splitlines()]
    assert test_cmd in lines
    venv = [i for i, ln in enumerate(lines) if re.match(r"python3? -m venv ", ln)]
    activate = [i for i, ln in enumerate(lines) if re.match(r"(\.|source) .*bin/activate", ln)]
    assert venv and activate, "CI must create and activate a virtual environment of its own"
    assert "--system-site-packages" not in lines[venv[0]]
    assert venv[0] < activate[0] < lines.index(test_cmd)
    assert "torch==2.13.0" in run_cmd and "torch==2.13.0" in test_cmd


def test_main_job_exists():
    run_cmd, _ = _readme_commands()
    script = run_cmd.split()[-1]
    assert os.path.exists(os.path.join(ROOT, script)), script
