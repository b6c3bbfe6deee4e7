"""The README's promise: `serve.sh`'s server (demo mode, SmolLM2, the demo adapters) answers the
README's OpenAI SDK example as written, with the key it printed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.platform.servers import start_server

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_sdk_example() -> str:
    section = README.read_text().split("## Calling it", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.smollm2
def test_the_readme_example_works_against_the_demo_server(tmp_path, smollm2_dir):
    server = start_server(smollm2_dir, tmp_path, extra_args=("--demo",))
    try:
        deadline = time.monotonic() + 60
        while "demo API key" not in server.output() and time.monotonic() < deadline:
            time.sleep(0.2)
        output = server.output()
        key = re.search(r"demo API key \(shown once\): (\S+)", output).group(1)
        assert "demo tenant 'demo', adapters: ahoy, uppercase" in output
        assert f"serving SmolLM2-135M-Instruct at {server.url}/v1" in output
        code = readme_sdk_example().replace("http://127.0.0.1:8000", server.url)
        env = {**os.environ, "OPENAI_API_KEY": key}
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("Ahoy!")
    finally:
        assert server.stop() == 0
