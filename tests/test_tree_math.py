"""optax's tree_utils math (fadam._tree_math): each function against its definition written out with torch ops."""

from __future__ import annotations

import math

import pytest
import torch

import fadam

F64 = torch.float64


def _real(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(2, 3, generator=g, dtype=F64),
        "b": torch.randn(4, generator=g, dtype=F64),
        "skip": None,
    }


def _mixed(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(2, 3, generator=g, dtype=F64),
        "z": torch.randn(3, generator=g, dtype=torch.complex128),
        "skip": None,
    }


def _same(out: dict, expected: dict) -> None:
    assert out.keys() == expected.keys()
    for key, want in expected.items():
        if want is None:
            assert out[key] is None
        else:
            assert out[key].dtype == want.dtype
            torch.testing.assert_close(out[key], want, rtol=1e-12, atol=1e-12)


def _close(value: torch.Tensor, want: torch.Tensor | float) -> None:
    assert isinstance(value, torch.Tensor) and value.dim() == 0
    torch.testing.assert_close(value, torch.as_tensor(want, dtype=value.dtype), rtol=1e-12, atol=1e-12)


def test_leafwise_binary() -> None:
    x, y = _mixed(0), _mixed(1)
    _same(fadam.tree_mul(x, y), {"w": x["w"] * y["w"], "z": x["z"] * y["z"], "skip": None})
    _same(fadam.tree_div(x, y), {"w": x["w"] / y["w"], "z": x["z"] / y["z"], "skip": None})
    for scalar in (0.3, torch.tensor(-1.5, dtype=F64)):
        want = {"w": x["w"] + scalar * y["w"], "z": x["z"] + scalar * y["z"], "skip": None}
        _same(fadam.tree_add_scale(x, scalar, y), want)
        _same(fadam.tree_add_scalar_mul(x, scalar, y), want)


def test_vdot_conjugates_the_first_argument() -> None:
    x, y = _mixed(0), _mixed(1)
    want = (x["w"] * y["w"]).sum() + (x["z"].conj() * y["z"]).sum()
    _close(fadam.tree_vdot(x, y), want)
    assert fadam.tree_vdot(x, y).dtype == torch.complex128
    _close(fadam.tree_vdot({"a": None}, {"a": None}), 0.0)


def test_reductions() -> None:
    x = _real(0)
    _close(fadam.tree_sum(x), x["w"].sum() + x["b"].sum())
    _close(fadam.tree_sum(x, associative_reduction=True), x["w"].sum() + x["b"].sum())
    _close(fadam.tree_max(x), torch.maximum(x["w"].max(), x["b"].max()))
    _close(fadam.tree_min(x), torch.minimum(x["w"].min(), x["b"].min()))
    empty = {**x, "e": torch.zeros(0, dtype=F64)}
    _close(fadam.tree_max(empty), fadam.tree_max(x))
    _close(fadam.tree_min(empty), fadam.tree_min(x))
    assert fadam.tree_max({"a": None}).item() == -math.inf
    assert fadam.tree_min([]).item() == math.inf
    assert fadam.tree_size(x) == 10 and fadam.tree_size(_mixed()) == 9 and fadam.tree_size({}) == 0
    z = _mixed(0)
    _close(fadam.tree_sum(z), z["w"].sum() + z["z"].sum())


@pytest.mark.parametrize("squared", [False, True])
def test_norms(squared: bool) -> None:
    x = _mixed(0)
    w, z = x["w"], x["z"]
    sq = (w * w).sum() + (z.real * z.real + z.imag * z.imag).sum()
    l2 = sq if squared else torch.sqrt(sq)
    l1 = w.abs().sum() + z.abs().sum()
    linf = torch.maximum(w.abs().max(), z.abs().max())
    if squared:
        l1, linf = l1 * l1, linf * linf
    for ord in (None, 2):
        _close(fadam.tree_norm(x, ord=ord, squared=squared), l2)
    _close(fadam.tree_norm(x, ord=1, squared=squared), l1)
    for ord in (math.inf, "inf", "infinity"):
        _close(fadam.tree_norm(x, ord=ord, squared=squared), linf)
    _close(fadam.tree_l2_norm(x, squared=squared), l2)
    if not squared:
        _close(fadam.tree_l1_norm(x), l1)
        _close(fadam.tree_linf_norm(x), linf)
        _close(fadam.tree_norm(x), fadam.tree_global_norm(x))
    assert fadam.tree_norm(x).dtype == F64
    with pytest.raises(ValueError, match="Unsupported ord"):
        fadam.tree_norm(x, ord=3)


def test_conj_real_and_batch_shape() -> None:
    x = _mixed(0)
    conj = fadam.tree_conj(x)
    _same(conj, {"w": x["w"], "z": torch.conj_physical(x["z"]), "skip": None})
    assert not conj["z"].is_conj()
    _same(fadam.tree_real(x), {"w": x["w"], "z": x["z"].real, "skip": None})
    batched = fadam.tree_batch_shape(x, (2, 1))
    _same(batched, {"w": x["w"].expand(2, 1, 2, 3), "z": x["z"].expand(2, 1, 3), "skip": None})
    _same(fadam.tree_batch_shape(x), x)


def test_constant_trees() -> None:
    x = _mixed(0)
    _same(
        fadam.tree_ones_like(x),
        {"w": torch.ones(2, 3, dtype=F64), "z": torch.ones(3, dtype=torch.complex128)} | {"skip": None},
    )
    _same(
        fadam.tree_ones_like(x, dtype=torch.float32),
        {"w": torch.ones(2, 3), "z": torch.ones(3, dtype=torch.complex64), "skip": None},
    )
    _same(
        fadam.tree_full_like(x, 2.5),
        {"w": torch.full((2, 3), 2.5, dtype=F64), "z": torch.full((3,), 2.5, dtype=torch.complex128), "skip": None},
    )
    _same(
        fadam.tree_zeros_like(x),
        {"w": torch.zeros(2, 3, dtype=F64), "z": torch.zeros(3, dtype=torch.complex128)} | {"skip": None},
    )


def test_clip_and_where() -> None:
    x, y = _real(0), _real(1)
    _same(fadam.tree_clip(x, -0.5, 0.5), {"w": x["w"].clamp(-0.5, 0.5), "b": x["b"].clamp(-0.5, 0.5), "skip": None})
    _same(fadam.tree_clip(x, max_value=0.1), {"w": x["w"].clamp(max=0.1), "b": x["b"].clamp(max=0.1), "skip": None})
    _same(fadam.tree_clip(x, min_value=0.1), {"w": x["w"].clamp(min=0.1), "b": x["b"].clamp(min=0.1), "skip": None})
    _same(fadam.tree_clip(x), x)
    for cond in (True, torch.tensor(True)):
        _same(fadam.tree_where(cond, x, y), x)
    for cond in (False, torch.tensor(False)):
        _same(fadam.tree_where(cond, x, y), y)
    mask = x["b"] > 0
    out = fadam.tree_where(mask, {"b": x["b"]}, {"b": y["b"]})
    _same(out, {"b": torch.where(mask, x["b"], y["b"])})


def test_moments() -> None:
    g, t = _mixed(0), _mixed(1)
    t = {"w": t["w"].abs(), "z": t["z"].abs(), "skip": None}
    decay = 0.9
    for order in (1, 2, 3):
        _same(
            fadam.tree_update_moment(g, t, decay, order),
            {
                "w": (1 - decay) * g["w"] ** order + decay * t["w"],
                "z": (1 - decay) * g["z"] ** order + decay * t["z"],
                "skip": None,
            },
        )
        z_abs_sq = g["z"].real ** 2 + g["z"].imag ** 2
        half = order / 2
        half = int(half) if half.is_integer() else half
        _same(
            fadam.tree_update_moment_per_elem_norm(g, t, decay, order),
            {
                "w": (1 - decay) * g["w"] ** order + decay * t["w"],
                "z": (1 - decay) * z_abs_sq**half + decay * t["z"],
                "skip": None,
            },
        )
    r = {"w": g["w"], "z": g["z"].abs(), "skip": None}
    _same(
        fadam.tree_update_infinity_moment(r, t, decay, 1e-3),
        {
            "w": torch.maximum(g["w"].abs() + 1e-3, decay * t["w"]),
            "z": torch.maximum(r["z"].abs() + 1e-3, decay * t["z"]),
            "skip": None,
        },
    )


def test_bias_correction() -> None:
    x = _mixed(0)
    for count in (3, torch.tensor(3), torch.tensor(3, dtype=torch.int32)):
        correction = 1 - 0.9**3
        _same(
            fadam.tree_bias_correction(x, 0.9, count),
            {"w": x["w"] / correction, "z": x["z"] / correction} | {"skip": None},
        )
    low = {"h": torch.ones(2, dtype=torch.bfloat16)}
    assert fadam.tree_bias_correction(low, 0.999, torch.tensor(1))["h"].dtype == torch.bfloat16


def test_inputs_are_left_alone() -> None:
    x, y = _mixed(0), _mixed(1)
    before = {k: (v.clone(), v._version) for k, v in x.items() if v is not None}
    fadam.tree_add_scale(x, 2.0, y)
    fadam.tree_update_moment(x, y, 0.9, 2)
    fadam.tree_bias_correction(x, 0.9, 2)
    fadam.tree_conj(x)
    for key, (value, version) in before.items():
        assert torch.equal(x[key], value) and x[key]._version == version
