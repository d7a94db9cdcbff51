"""Run a script as a distributed job of N CPU ranks, the way the FSDP tests and examples are run."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(ranks: int, script: Path, *args: str) -> str:
    """``script`` with torchrun for several ranks; one rank runs in a plain process (the launcher costs seconds).
    Fails with the job's output unless every rank exits 0; returns its stdout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if ranks == 1:
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        command = [sys.executable]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    result = subprocess.run(
        [*command, str(script), *args], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT, check=False
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result.stdout
