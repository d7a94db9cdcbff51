"""``examples/fsdp_transformer.py`` trains with ``fadam.adamw8bit`` on 2 CPU ranks (FSDP2, gloo), saves a DCP
checkpoint, and resumes from it on 1 rank (resharding the 8-bit state)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.launch import ROOT, run_ranks

TINY = ["--dim", "32", "--layers", "1", "--heads", "2", "--seq", "16", "--batch", "8", "--lr", "1e-2"]
TINY += ["--log-every", "5", "--device", "cpu"]


def _run(ranks: int, *args: str) -> str:
    return run_ranks(ranks, ROOT / "examples" / "fsdp_transformer.py", *TINY, *args)


def _losses(out: str) -> tuple[float, float, float]:
    found = re.search(r"uniform guess ([\d.]+); first logged loss ([\d.]+); final loss ([\d.]+)", out)
    assert found, out
    return tuple(float(x) for x in found.groups())


def test_trains_on_two_ranks_and_resumes_on_one(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    out = _run(2, "--steps", "20", "--checkpoint", str(checkpoint))
    uniform, first, final = _losses(out)
    assert "2 ranks" in out and final < 0.5 * first < uniform, out
    assert re.search(r"8-bit moments for [1-9]\d* of", out), out  # the tiny model's MLP weights are quantized

    resumed = _run(1, "--steps", "5", "--checkpoint", str(checkpoint))
    assert f"resumed from {checkpoint}" in resumed, resumed
    # the restored model and AdamW moments (8-bit ones requantized on one rank) carry on where training stopped, far
    # below a fresh start
    assert _losses(resumed)[1] < 0.5 * first, resumed
