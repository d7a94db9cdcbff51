"""``examples/fsdp_transformer.py`` trains with ``fadam.adamw8bit`` on 2 CPU ranks (FSDP2, gloo), saves a DCP
checkpoint, and resumes from it on 1 rank (resharding the 8-bit state)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--dim", "32", "--layers", "1", "--heads", "2", "--seq", "16", "--batch", "8", "--lr", "1e-2"]
TINY += ["--log-every", "5", "--device", "cpu"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(ranks: int, *args: str) -> str:
    """With torchrun for several ranks; one rank runs in a plain process (the launcher costs seconds)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if ranks == 1:
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        command = [sys.executable]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    result = subprocess.run(
        [*command, str(ROOT / "examples" / "fsdp_transformer.py"), *TINY, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result.stdout


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
