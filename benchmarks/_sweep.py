"""The exhaustive checks' inputs: every float32 whose magnitude lies in a range, both signs, a chunk at a time."""

from __future__ import annotations

from collections.abc import Iterator

import torch


def signed_floats(least_bits: int, most_bits: int, chunk: int = 1 << 24) -> Iterator[torch.Tensor]:
    """Float32 tensors that together hold every value whose magnitude's bit pattern lies in ``[least_bits,
    most_bits]``, each chunk of patterns positive and then negative (``-0.0`` included where 0 is)."""
    for lo in range(least_bits, most_bits + 1, chunk):
        bits = torch.arange(lo, min(lo + chunk, most_bits + 1), dtype=torch.int32)
        for sign in (0, -(1 << 31)):
            yield (bits | sign).view(torch.float32)
