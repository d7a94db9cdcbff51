"""Runs examples/train_module.py with small settings (in process, as the script's own ``main``)."""

from __future__ import annotations

import runpy
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_train_module_example_learns_and_reports(capsys):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: one thread avoids oversubscription on a shared machine
    try:
        main = runpy.run_path(str(ROOT / "examples" / "train_module.py"))["main"]
        summary = main(["--steps", "60", "--batch-size", "32", "--device", "cpu"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "device=cpu amp=bfloat16 steps=60" in out
    assert summary["steps"] == 60  # every step was taken (bfloat16 needs no loss scaling, nothing skipped)
    assert summary["final_loss"] < 0.7 * summary["first_loss"]
    assert summary["accuracy"] > 0.5  # 4 classes: chance is 0.25
    assert summary["final_lr"] < 1e-4  # OneCycleLR annealed the lr that fadam.Optimizer used
