"""The maintainer tools in scripts/: each answers --help, and a bad flag is one stderr line and exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[2] / "scripts").glob("*.py"))


def run(script: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=120)


def test_the_scripts_are_there():
    assert {s.name for s in SCRIPTS} >= {"gpu_check.py", "kernel_ab.py", "kernel_stream.py", "forward_loop.py"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.name)
def test_help(script):
    r = run(script, "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage:") and "--help" in r.stdout


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.name)
def test_a_bad_flag_is_one_line(script):
    r = run(script, "--no-such-flag", "--out", "unused", "a=b")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0] and "--no-such-flag" in lines[0], r.stderr
    assert "Traceback" not in r.stderr and not r.stdout
