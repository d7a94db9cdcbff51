"""Writes tests/data/bitsandbytes_adam8bit.json: a run of bitsandbytes' ``Adam8bit`` on the CPU, for
tests/test_bridge_bitsandbytes.py.

Two params, ``w`` of 4224 elements (8-bit state: 17 blocks of 256, the last one of 128) and ``b`` of 10 (below
``min_8bit_size``: float32 state), step ``STEPS_BEFORE`` times on fixed gradients (exact binary fractions, computed as
the test computes them, so they need not be stored). Stored: the params and the optimizer's ``state_dict`` at that
point (codes, absmax, maps and step, in its layout: the test decodes the codes as ``qmap[code] * absmax`` of the
element's block, which this script checks is bitsandbytes' own dequantization, bit for bit), and the params after
each of ``STEPS_AFTER`` more steps. Values are float32, written as the shortest decimals that read back
as the same float32.

Needs bitsandbytes (CPU support: 0.45 or later), which fadam does not depend on; run once where it is installed:
    pip install --target /tmp/bnb-deps --no-deps bitsandbytes
    PYTHONPATH=/tmp/bnb-deps python scripts/bitsandbytes_state_reference.py
"""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path
from typing import Any

import bitsandbytes as bnb
import bitsandbytes.functional as F
import numpy as np
import torch

SHAPES = {"w": (33, 128), "b": (10,)}
HYPERPARAMETERS = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}
STEPS_BEFORE, STEPS_AFTER = 3, 3


def start(name: str) -> torch.Tensor:
    i = torch.arange(int(np.prod(SHAPES[name])))
    return (((i * 37 + len(name)) % 101 - 50) / 64).float().reshape(SHAPES[name])


def gradient(name: str, t: int) -> torch.Tensor:
    """Step ``t``'s gradient: signs that vary, and a scale that halves from one block of 256 to the next (cycling)."""
    i = torch.arange(int(np.prod(SHAPES[name])))
    return (((i * 7 + t * 31 + len(name)) % 61 - 30) / 32 * 0.5 ** (i // 256 % 4)).float().reshape(SHAPES[name])


def floats(x: torch.Tensor) -> list[float]:
    return [float(str(v)) for v in x.detach().float().reshape(-1).numpy()]  # shortest float32 decimals


def packed(value: Any) -> Any:
    """A state_dict value as JSON: tensors as flat lists (uint8 codes as ints), containers walked."""
    if isinstance(value, torch.Tensor):
        return value.reshape(-1).tolist() if value.dtype == torch.uint8 else floats(value)
    if isinstance(value, dict):
        return {str(k): packed(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [packed(v) for v in value]
    return value


def main() -> None:
    params = {name: torch.nn.Parameter(start(name)) for name in SHAPES}
    opt = bnb.optim.Adam8bit(list(params.values()), **HYPERPARAMETERS)

    def step(t: int) -> None:
        for name, p in params.items():
            p.grad = gradient(name, t)
        opt.step()

    for t in range(STEPS_BEFORE):
        step(t)
    state = opt.state[params["w"]]
    for n in (1, 2):  # the test decodes the codes so: check that this is bitsandbytes' own dequantization
        theirs = F.dequantize_blockwise(
            state[f"state{n}"], absmax=state[f"absmax{n}"], code=state[f"qmap{n}"], blocksize=256
        )
        scales = state[f"absmax{n}"].repeat_interleave(256)[: theirs.numel()].reshape(theirs.shape)
        assert torch.equal(state[f"qmap{n}"][state[f"state{n}"].long()] * scales, theirs)
    out: dict[str, Any] = {
        "bitsandbytes": version("bitsandbytes"),
        "torch": torch.__version__,
        "optimizer": type(opt).__name__,
        "hyperparameters": HYPERPARAMETERS,
        "shapes": SHAPES,
        "steps_before": STEPS_BEFORE,
        "params": {name: floats(p) for name, p in params.items()},
        "state_dict": packed(opt.state_dict()),
    }
    continued = []
    for t in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
        step(t)
        continued.append({name: floats(p) for name, p in params.items()})
    out["continued"] = continued
    path = Path(__file__).resolve().parent.parent / "tests" / "data" / "bitsandbytes_adam8bit.json"
    path.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
