"""The examples run end to end (with small settings) and report what they promise."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_example(script: str, *args: str, timeout: float = 300) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_quickstart_trains_to_high_accuracy() -> None:
    out = run_example("quickstart.py", "--steps", "300")
    accuracy = float(re.search(r"test accuracy ([\d.]+)%", out).group(1))
    assert accuracy > 90.0, out
