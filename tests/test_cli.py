"""The `loraplex` command as a user runs it."""

from __future__ import annotations

import subprocess
import sys


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "loraplex.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_generate_answers_a_prompt(tiny_llama):
    done = run_cli("generate", "--model", str(tiny_llama), "--max-tokens", "8", "the river")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()


def test_generate_reports_a_bad_model_directory(tmp_path):
    done = run_cli("generate", "--model", str(tmp_path), "hello")
    assert done.returncode == 2
    assert "neither 'default' nor a checkpoint directory" in done.stderr
