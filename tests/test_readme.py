"""The README's two fresh-machine commands and CI stay in step."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme_commands():
    text = open(os.path.join(ROOT, "README.md")).read()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    return [b.strip() for b in blocks[:2]]


def test_ci_runs_the_readme_test_command():
    run_cmd, test_cmd = _readme_commands()
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert test_cmd in ci.splitlines()
    assert "torch==2.13.0" in run_cmd and "torch==2.13.0" in test_cmd


def test_main_job_exists():
    run_cmd, _ = _readme_commands()
    script = run_cmd.split()[-1]
    assert os.path.exists(os.path.join(ROOT, script)), script
