"""The quantized-state example runs (tiny) and the notebook executes on the committed results."""

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]


def test_charlm_example_tiny(tmp_path):
    out = tmp_path / "results.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(ROOT / "examples" / "quantized_charlm.py"), "--tiny", "--pure", "--steps", "6"]
    cmd += ["--eval-every", "3", "--threads", "1", "--out", str(out)]
    subprocess.run(cmd, check=True, env=env, cwd=tmp_path, capture_output=True, timeout=300)
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"fp32", "8bit", "4bit"}
    assert abs(results["fp32"]["state_bytes_per_param"] - 8.0) < 1e-3
    assert results["4bit"]["state_bytes_per_param"] < results["8bit"]["state_bytes_per_param"] < 8.0
    assert all(len(r["curve"]) == 2 for r in results.values())


def test_committed_results_meet_the_accuracy_targets():
    results = json.loads((ROOT / "examples" / "quantized_charlm_results.json").read_text())["results"]
    assert abs(results["8bit"]["relative_to_fp32"]) <= 0.01
    assert abs(results["4bit"]["relative_to_fp32"]) <= 0.03


def test_notebook_executes(tmp_path):
    nb = nbformat.read(ROOT / "notebooks" / "quantized_state.ipynb", as_version=4)
    NotebookClient(
        nb, timeout=60, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "notebooks")}}
    ).execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "8bit: final val loss" in text and "4bit: final val loss" in text
