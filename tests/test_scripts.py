"""Every script under scripts/ still starts: each Python script answers --help on a machine
without a GPU (a script whose imports or engine names went stale fails here, not on the GPU
machine), and each shell script parses. Every file there is one or the other, so a new script
cannot escape both checks."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
FILES = sorted(p for p in SCRIPTS.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def test_every_script_is_checked():
    assert FILES
    others = [str(p.relative_to(SCRIPTS)) for p in FILES
              if p.parent != SCRIPTS or p.suffix not in (".py", ".sh")]
    assert not others, f"not a .py or .sh file directly in scripts/: {others}"


@pytest.mark.parametrize("script", [p for p in FILES if p.suffix == ".py"], ids=lambda p: p.name)
def test_python_script_answers_help(script):
    env = {**os.environ, "PYTHONPATH": str(SCRIPTS.parent), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True,
                          text=True, env=env, cwd=SCRIPTS.parent, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: "), done.stdout


@pytest.mark.parametrize("script", [p for p in FILES if p.suffix == ".sh"], ids=lambda p: p.name)
def test_shell_script_parses(script):
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
