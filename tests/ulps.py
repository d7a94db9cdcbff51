"""Distances between floating tensors in units in the last place, for the tests that bound a backend's numbers."""

from __future__ import annotations

import torch

INTEGERS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16}


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between ``a`` and ``b`` in units in the last place, element by element: 0 for equal bits
    (a zero's sign counts: 1 between 0 and -0) and between NaNs, a huge number between a NaN and a number."""
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype not in INTEGERS:
        return 0 if torch.equal(a, b) else 1 << 62  # a step count
    if a.numel() == 0:
        return 0

    def ordered(t: torch.Tensor) -> torch.Tensor:  # monotone in the value; -0 just below +0
        bits = t.view(INTEGERS[t.dtype]).to(torch.int64)
        magnitude = bits & ((1 << (8 * t.element_size() - 1)) - 1)
        return torch.where(bits < 0, -magnitude - 1, magnitude)

    distance = (ordered(a) - ordered(b)).abs()
    distance = torch.where(a.isnan() & b.isnan(), 0, distance)
    distance = torch.where(a.isnan() != b.isnan(), 1 << 62, distance)
    return int(distance.max())


def ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of ``x``'s dtype at each element's magnitude, in float64."""
    info = torch.finfo(x.dtype)
    wide = x.double()
    spacing = torch.ldexp(torch.ones_like(wide), torch.frexp(wide).exponent - 1) * info.eps
    return torch.where(wide == 0, info.smallest_normal * info.eps, spacing).clamp(min=info.smallest_normal * info.eps)


def param_ulps(found: torch.Tensor, eager: torch.Tensor, update: torch.Tensor) -> int:
    """How far a new param ``found`` is from the eager path's, in ulps of the update, beyond the param's own rounding:
    a param of ``p + u'`` where ``u'`` is ``n`` ulps off ``u`` is at most ``n`` ulps of ``u`` plus one of the param
    away (0: bit for bit; a cancellation in ``p + u`` can make those many ulps of the param)."""
    if ulps(found, eager) == 0:
        return 0
    excess = (found.double() - eager.double()).abs() - ulp(eager)
    distance = torch.ceil(excess.clamp(min=0) / ulp(update)).clamp(min=1)
    distance = torch.where(found.view(INTEGERS[found.dtype]) == eager.view(INTEGERS[eager.dtype]), 0, distance)
    return int(torch.nan_to_num(distance, nan=2.0**62, posinf=2.0**62).max())
