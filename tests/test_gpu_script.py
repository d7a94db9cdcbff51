"""The prepared GPU script (``benchmarks/gpu.py``) starts and runs every part: on the CPU, at small sizes, with the
Triton kernels in Triton's interpreter. Its figures are not checked here (they are a GPU's to give)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu.py"


def test_every_part_runs_on_the_cpu_and_writes_its_report(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "OUT": str(tmp_path)}
    command = [sys.executable, str(SCRIPT), "--device", "cpu", "--small", "--rounds", "1"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = (tmp_path / "gpu.txt").read_text()
    for part in ("## 1.", "## 2.", "## 3.", "## 4."):
        assert part in report
    assert "Traceback" not in report and "failed" not in report, report
    kernel_lines = [line for line in report.splitlines() if "triton backend:" in line]
    assert len(kernel_lines) == 6  # one line per chain (float32 only, at small sizes)
    # on the Triton backend, in the interpreter, a chain without quantized state runs the generated Triton kernel
    # and equals the eager path (IEEE square roots aside: adamw's may differ in a last bit, lion's has none)
    lion = next(line for line in kernel_lines if line.split()[0] == "lion" and "float32" in line)
    assert "triton 0" in lion and "generated Triton kernel" in lion, lion
