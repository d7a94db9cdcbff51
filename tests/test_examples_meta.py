"""The meta-learning example and notebook run end to end (tiny settings for the example)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import nbclient
import nbformat

ROOT = Path(__file__).resolve().parents[1]


def test_maml_sinusoid_example_runs_tiny_and_adapts() -> None:
    args = ["--iterations", "150", "--meta-batch", "10", "--test-tasks", "100", "--log-every", "0"]
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "maml_sinusoid.py"), *args],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    mse = {m[0].strip(): float(m[1]) for m in re.findall(r"^([A-Za-z-]+, \d+ steps?)\s+([\d.]+)$", result.stdout, re.M)}
    assert len(mse) == 6, result.stdout
    # even after 150 iterations, one inner step from the meta-learned init helps, and a learned inner lr helps more
    assert mse["MAML, 1 step"] < mse["MAML, 0 steps"], mse
    assert mse["Meta-SGD, 1 step"] < mse["MAML, 1 step"], mse


def test_meta_learning_notebook_executes() -> None:
    notebook = nbformat.read(ROOT / "notebooks" / "meta_learning.ipynb", as_version=4)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    os.environ.setdefault("MPLBACKEND", "Agg")
    nbclient.NotebookClient(notebook, timeout=120, resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = "".join(
        o.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])
    )
    difference = float(re.search(r"max difference: ([\d.e+-]+)", outputs)[1])
    assert difference < 1e-5, outputs
    assert "truncate=3" in outputs and "init gets a gradient: False" in outputs, outputs
