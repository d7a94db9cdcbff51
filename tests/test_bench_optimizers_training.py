"""benchmarks/bench_optimizers_training.py at its tiny size: every optimizer trains every model, from one init, to a
finite validation loss; the committed results hold the same."""

from __future__ import annotations

import json
import math
import runpy
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
OPTIMIZERS = {"adamw", "muon", "schedule_free_adamw", "soap", "prodigy", "adopt"}
MODELS = {"charlm", "teacher_mlp"}


def check_report(report: dict, steps: int) -> None:
    assert set(report["models"]) == MODELS
    for model in report["models"].values():
        runs = model["optimizers"]
        assert set(runs) == OPTIMIZERS
        # one init for every optimizer: the same loss before the first step
        assert len({r["curve"][0][1] for r in runs.values()}) == 1
        for r in runs.values():
            assert r["curve"][0][0] == 0 and r["curve"][-1][0] == steps
            assert all(math.isfinite(loss) for _, loss in r["curve"])
            assert r["final_val_loss"] == r["curve"][-1][1]
        assert runs["adamw"]["optimizer_step_ratio"] == runs["adamw"]["train_step_ratio"] == 1.0
        assert all(r["optimizer_step_ms"] > 0 and r["train_step_ratio"] > 0 for r in runs.values())


def test_tiny_run_reports_every_optimizer_on_every_model(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "results.json"
    threads = torch.get_num_threads()
    try:  # in process, as the script's own main; eager: no kernel to compile in a fresh cache
        main = runpy.run_path(str(ROOT / "benchmarks" / "bench_optimizers_training.py"))["main"]
        main(["--tiny", "--threads", "1", "--backend", "eager", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    report = json.loads(out.read_text())
    check_report(report, steps=4)
    assert report["config"]["tiny"] and report["machine"]["threads"] == 1
    assert "teacher_mlp  schedule_free_adamw" in capsys.readouterr().out  # the table


def test_committed_results_hold_every_optimizer_on_every_model() -> None:
    report = json.loads((ROOT / "benchmarks" / "optimizers_training_results.json").read_text())
    check_report(report, steps=report["config"]["steps"])
    for model in report["models"].values():
        # every optimizer learns: its final loss is below the loss at init
        assert all(r["final_val_loss"] < r["curve"][0][1] - 0.5 for r in model["optimizers"].values())
