"""fadam.state_from_torch / fadam.state_to_torch with bitsandbytes' 8-bit Adam: a run of bitsandbytes' ``Adam8bit``
(tests/data/bitsandbytes_adam8bit.json, written by scripts/bitsandbytes_state_reference.py on the CPU) continues in
``fadam.adamw8bit`` (bitsandbytes' Adam decays weights decoupled), and fadam's state converts back into bitsandbytes'
layout. bitsandbytes is not needed: its run is stored, and its optimizer is stood in for by a class that has what
fadam reads of it.

Bounds: a value that fadam requantizes is off by at most half the largest gap of the map times its block's scale
(``HALF_GAP``: 0.0069 of the scale for the signed map of first moments, 0.0035 for the unsigned map of second
moments; bitsandbytes' maps: 0.0070 and 0.0035).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import optree
import pytest
import torch

import fadam
from fadam.quantization import dequantize_blockwise, dynamic_map, quantize_blockwise

DATA = json.loads((Path(__file__).parent / "data" / "bitsandbytes_adam8bit.json").read_text())
SHAPES = {name: tuple(shape) for name, shape in DATA["shapes"].items()}
HYPER = DATA["hyperparameters"]
WRAPPED = "__bnb_optimizer_quant_state__"
BLOCK = 256
# half the largest gap between neighbouring values of fadam's maps: the bound of requantizing, per unit of scale
HALF_GAP = {signed: float(dynamic_map(signed, 8).diff().max()) / 2 for signed in (True, False)}
ULPS = 2.0**-20  # float32 rounding of the values decoded, per unit of scale: a few units in the last place
# fadam continuing bitsandbytes' run: the params after each step within this many learning rates of bitsandbytes'
# (the two quantize the moments with different maps; measured: 0.007, 0.018 and 0.033 after one, two and three steps)
TRAJECTORY_TOLERANCE = 0.1


def _gradient(name: str, t: int) -> torch.Tensor:
    """Step ``t``'s gradient, as scripts/bitsandbytes_state_reference.py computes it."""
    i = torch.arange(torch.Size(SHAPES[name]).numel())
    return (((i * 7 + t * 31 + len(name)) % 61 - 30) / 32 * 0.5 ** (i // 256 % 4)).float().reshape(SHAPES[name])


def _params(values: dict[str, list[float]]) -> dict[str, torch.Tensor]:
    return {name: torch.tensor(values[name]).reshape(SHAPES[name]) for name in SHAPES}


def _entry(saved: dict[str, Any], shape: tuple[int, ...]) -> dict[str, Any]:
    """One param's state in bitsandbytes' state_dict layout, as tensors."""
    quant = saved[WRAPPED]
    eight_bit = "qmap1" in quant

    def tensor(key: str, values: list) -> torch.Tensor:
        if key.startswith("state"):
            return torch.tensor(values, dtype=torch.uint8 if eight_bit else torch.float32).reshape(shape)
        return torch.tensor(values, dtype=torch.float32)

    return {"step": saved["step"], WRAPPED: {key: tensor(key, values) for key, values in quant.items()}}


def _state_dict() -> dict[str, Any]:
    saved = DATA["state_dict"]
    shapes = list(SHAPES.values())
    return {
        "state": {int(index): _entry(entry, shapes[int(index)]) for index, entry in saved["state"].items()},
        "param_groups": saved["param_groups"],
    }


def _decoded(quant: dict[str, torch.Tensor], number: int) -> torch.Tensor:
    """bitsandbytes' dequantization of moment ``number``: ``qmap[code]`` times its block's scale."""
    codes = quant[f"state{number}"]
    scales = quant[f"absmax{number}"].repeat_interleave(BLOCK)[: codes.numel()].reshape(codes.shape)
    return quant[f"qmap{number}"][codes.long()] * scales


def _block_scales(x: torch.Tensor) -> torch.Tensor:
    """Each element's block scale: the largest magnitude of its block of 256."""
    flat = x.reshape(-1)
    blocks = torch.nn.functional.pad(flat, (0, -flat.numel() % BLOCK)).reshape(-1, BLOCK)
    return blocks.abs().amax(dim=-1).repeat_interleave(BLOCK)[: flat.numel()].reshape(x.shape)


def _tx() -> fadam.GradientTransformation:
    return fadam.adamw8bit(
        lr=HYPER["lr"], betas=tuple(HYPER["betas"]), eps=HYPER["eps"], weight_decay=HYPER["weight_decay"]
    )


def _moments(state: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """fadam.adamw8bit's moments, dequantized where they are quantized."""
    inner = state[0].inner_state

    def values(x: Any) -> torch.Tensor:
        return dequantize_blockwise(x, bits=8, block_size=BLOCK) if isinstance(x, fadam.QuantizedArray) else x

    return {k: values(v) for k, v in inner.mu.items()}, {k: values(v) for k, v in inner.nu.items()}


def _converted() -> Any:
    return fadam.state_from_torch(_state_dict(), _tx(), _params(DATA["params"]))


def test_the_moments_convert_within_the_bound_of_requantizing_them_with_fadams_maps():
    state = _converted()
    inner = state[0].inner_state
    assert int(inner.count) == DATA["steps_before"]
    assert isinstance(inner.mu["w"], fadam.QuantizedArray) and isinstance(inner.nu["w"], fadam.QuantizedArray)
    mu, nu = _moments(state)
    quant = _state_dict()["state"][0][WRAPPED]
    for ours, number, signed in ((mu["w"], 1, True), (nu["w"], 2, False)):
        theirs = _decoded(quant, number)
        error = (ours - theirs).abs()
        bound = _block_scales(theirs) * (HALF_GAP[signed] + ULPS)
        assert bool((error <= bound).all()), float((error - bound).max())
        assert float(error.max()) > 0.3 * float(bound.max())  # the maps differ: the values move
    small = _state_dict()["state"][1][WRAPPED]  # b: fewer than 4096 elements, float32 moments, taken as they are
    assert torch.equal(mu["b"], small["state1"]) and torch.equal(nu["b"], small["state2"])


def test_the_optimizers_own_state_with_its_keys_unwrapped_converts_the_same():
    flat = _state_dict()
    flat["state"] = {i: {"step": e["step"], **e[WRAPPED]} for i, e in flat["state"].items()}
    ours = fadam.state_from_torch(flat, _tx(), _params(DATA["params"]))
    for a, b in zip(optree.tree_leaves(ours), optree.tree_leaves(_converted())):
        assert torch.equal(a, b)


def _continued(state: Any, steps: int) -> list[dict[str, torch.Tensor]]:
    tx, params = _tx(), _params(DATA["params"])
    trajectory = []
    for t in range(DATA["steps_before"], DATA["steps_before"] + steps):
        params, state = fadam.step(tx, params, {name: _gradient(name, t) for name in SHAPES}, state)
        trajectory.append(params)
    return trajectory


def test_a_bitsandbytes_run_continues_in_fadam_on_its_trajectory():
    theirs = [_params(p) for p in DATA["continued"]]
    ours = _continued(_converted(), len(theirs))
    lr = HYPER["lr"]
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert float((a["w"] - b["w"]).abs().max()) <= TRAJECTORY_TOLERANCE * lr, step
        torch.testing.assert_close(a["b"], b["b"], rtol=1e-6, atol=1e-7)  # float32 state: Adam's rounding only
    start = _params(DATA["params"])["w"]
    assert float((theirs[-1]["w"] - start).abs().max()) > 2 * lr  # the run moved
    fresh = _continued(_tx().init(_params(DATA["params"])), len(theirs))
    assert float((fresh[-1]["w"] - theirs[-1]["w"]).abs().max()) > 5 * TRAJECTORY_TOLERANCE * lr  # the state matters


class Adam8bit(torch.optim.Optimizer):
    """What fadam reads of bitsandbytes' ``Adam8bit`` (its class's module, ``optimizer_name``, ``get_config``, the
    param groups and ``state_dict``), for converting state into it where bitsandbytes is not installed."""

    optimizer_name = "adam"

    def __init__(self, params: Any, optimizer_name: str = "adam", max_unorm: float = 0.0) -> None:
        defaults = {**HYPER, "alpha": 0.0, "t_alpha": None, "t_beta3": None}
        super().__init__(params, defaults)
        self.optimizer_name = optimizer_name
        self.max_unorm = max_unorm

    def get_config(self, gindex: int, pindex: int, group: dict[str, Any]) -> dict[str, Any]:
        return {"optim_bits": 8, "min_8bit_size": 4096, "max_unorm": self.max_unorm, "skip_zeros": False}


Adam8bit.__module__ = "bitsandbytes.optim.adam"


def _stand_in(**kwargs: Any) -> tuple[Adam8bit, dict[str, torch.nn.Parameter]]:
    params = {name: torch.nn.Parameter(p) for name, p in _params(DATA["params"]).items()}
    return Adam8bit(list(params.values()), **kwargs), params


def test_fadams_state_converts_back_into_bitsandbytes_state_dict_layout():
    state = _converted()
    opt, params = _stand_in()
    back = fadam.state_to_torch(state, params, opt)
    reference = _state_dict()
    assert back["param_groups"] == opt.state_dict()["param_groups"]
    assert back["state"].keys() == reference["state"].keys()
    for index, entry in back["state"].items():
        theirs = reference["state"][index]
        assert entry.keys() == theirs.keys() and entry["step"] == theirs["step"] and type(entry["step"]) is int
        assert entry[WRAPPED].keys() == theirs[WRAPPED].keys()
        for key, value in entry[WRAPPED].items():
            assert (value.dtype, value.shape) == (theirs[WRAPPED][key].dtype, theirs[WRAPPED][key].shape), key
    quant, theirs = back["state"][0][WRAPPED], reference["state"][0][WRAPPED]
    assert torch.equal(quant["qmap1"], theirs["qmap1"]) and torch.equal(quant["qmap2"], theirs["qmap2"])
    mu, nu = _moments(state)
    for fadams, number in ((mu["w"], 1), (nu["w"], 2)):
        half_gap = float(theirs[f"qmap{number}"].diff().max()) / 2
        bound = _block_scales(fadams) * (half_gap + ULPS)
        assert bool(((_decoded(quant, number) - fadams).abs() <= bound).all())
        assert torch.equal(quant[f"absmax{number}"], _block_scales(fadams).reshape(-1)[::BLOCK])
    small = back["state"][1][WRAPPED]  # float32 moments go back as they came
    assert torch.equal(small["state1"], reference["state"][1][WRAPPED]["state1"])
    assert torch.equal(small["state2"], reference["state"][1][WRAPPED]["state2"])


def test_a_bitsandbytes_state_converts_back_and_forth_within_the_bounds_of_both_maps():
    opt, params = _stand_in()
    again = fadam.state_from_torch(fadam.state_to_torch(_converted(), params, opt), _tx(), _params(DATA["params"]))
    quant = _state_dict()["state"][0][WRAPPED]
    for ours, number, signed in zip(_moments(again), (1, 2), (True, False)):
        theirs = _decoded(quant, number)
        bound = _block_scales(theirs) * (2 * HALF_GAP[signed] + float(quant[f"qmap{number}"].diff().max()) + ULPS)
        assert bool(((ours["w"] - theirs).abs() <= bound).all())


def test_a_torch_adam_run_converts_into_fadams_quantized_adam_and_back():
    w = torch.nn.Parameter(torch.linspace(-1, 1, 600))
    opt = torch.optim.Adam([w], lr=1e-2)
    for t in range(3):
        w.grad = torch.sin(torch.arange(600.0) * 0.37 + t)
        opt.step()
    tx = fadam.adam8bit(lr=1e-2, min_size=100, block_size=64)
    state = fadam.state_from_torch(opt, tx, [w])
    mu = state[0].inner_state.mu[0]
    assert mu.absmax.numel() == 10  # blocks of 64
    torch.testing.assert_close(
        dequantize_blockwise(mu, bits=8, block_size=64),
        dequantize_blockwise(quantize_blockwise(opt.state[w]["exp_avg"], 8, 64), bits=8, block_size=64),
        rtol=0,
        atol=0,
    )
    back = fadam.state_to_torch(state, [w], torch.optim.Adam([w], lr=1e-2))
    assert torch.equal(back["state"][0]["exp_avg"], dequantize_blockwise(mu, bits=8, block_size=64))


def test_a_quantized_leaf_whose_block_size_its_sizes_and_codes_do_not_tell_is_refused():
    q = quantize_blockwise(torch.linspace(-1, 1, 600), 8, 64)
    state = fadam.ScaleByAdamState(torch.tensor(1), [q._replace(absmax=q.absmax[:7])], [q])  # 7 blocks: no size fits
    with pytest.raises(ValueError, match=r"cannot tell the block size of quantized state of 600 elements in 7 blocks"):
        fadam.state_to_torch(state, [torch.zeros(600)], torch.optim.Adam([torch.zeros(600, requires_grad=True)]))
    i = torch.arange(5000.0)
    q = quantize_blockwise(torch.sin(i * 0.37) * (1 + i * 7919 % 13), 8, 250)  # 20 blocks, as many as of 256
    state = fadam.ScaleByAdamState(torch.tensor(1), [q], [q])
    with pytest.raises(ValueError, match=r"cannot tell the block size of quantized state of 5000 elements in 20"):
        fadam.state_to_torch(state, [torch.zeros(5000)], torch.optim.Adam([torch.zeros(5000, requires_grad=True)]))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda e: e[WRAPPED].pop("state2"), r"expected the keys of bitsandbytes' Adam state .* found \['absmax1'"),
        (lambda e: e[WRAPPED].update(unorm_vec=torch.zeros(1)), r"found \[.*'unorm_vec'\]"),
        (lambda e: e[WRAPPED].update(state1=e[WRAPPED]["state1"].expand(2, 33, 128)), r"state1 is \(2, 33, 128\)"),
        (lambda e: e[WRAPPED].update(absmax1=e[WRAPPED]["absmax1"][:-1]), r"absmax1 16 scales, expected 256 and .*17"),
    ],
    ids=["one-state (Lion8bit)", "update-norm clipping (LAMB8bit)", "two first moments (AdEMAMix8bit)", "absmax"],
)
def test_other_bitsandbytes_state_is_refused_naming_the_param(change, message):
    source = _state_dict()
    change(source["state"][0])
    with pytest.raises(ValueError, match=r"bitsandbytes state of param \['w'\]: .*" + message):
        fadam.state_from_torch(source, _tx(), _params(DATA["params"]))


def test_conversion_into_other_bitsandbytes_optimizers_is_refused():
    state = _converted()
    opt, params = _stand_in(optimizer_name="lion")
    with pytest.raises(ValueError, match=r"bitsandbytes' Adam family .*, not Adam8bit"):
        fadam.state_to_torch(state, params, opt)
    opt, params = _stand_in(max_unorm=1.0)
    with pytest.raises(ValueError, match="max_unorm clips the update's norm"):
        fadam.state_to_torch(state, params, opt)


def test_moments_that_bitsandbytes_8bit_state_cannot_hold_are_refused():
    state = _converted()
    inner = state[0].inner_state
    nu = {**inner.nu, "w": quantize_blockwise(torch.full(SHAPES["w"], float("inf")), 8, BLOCK)}  # fadam keeps infs
    state = (state[0]._replace(inner_state=inner._replace(nu=nu)), *state[1:])
    opt, params = _stand_in()
    with pytest.raises(ValueError, match=r"param group 0, param 0: a moment holds inf or nan"):
        fadam.state_to_torch(state, params, opt)


def test_paged_states_are_refused_both_ways():
    with pytest.raises(ValueError, match=r"a paged state .* does not convert"):
        fadam.state_from_torch(_state_dict(), fadam.paged_adamw8bit(lr=HYPER["lr"]), _params(DATA["params"]))
    tx = fadam.paged_adam(lr=1e-2)
    w = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match=r"a paged state .* does not convert"):
        fadam.state_to_torch(tx.init([w.detach()]), [w], torch.optim.Adam([w]))


def test_quantized_state_of_an_opaque_transform_is_refused():
    inner = fadam.trace(0.9)
    opaque = fadam.GradientTransformation(inner.init, lambda u, s, p=None: inner.update(u, s, p))
    w = torch.nn.Parameter(torch.ones(8))
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    w.grad = torch.ones(8)
    opt.step()
    with pytest.raises(ValueError, match=r"state\.inner_state\.trace\[0\] is quantized by a transform that declares"):
        fadam.state_from_torch(opt, fadam.quantize_state(opaque, min_size=1), [w])


def test_a_bitsandbytes_state_dict_loads_into_a_fadam_optimizer():
    params = {name: torch.nn.Parameter(p) for name, p in _params(DATA["params"]).items()}
    opt = fadam.Optimizer(params.items(), fadam.adamw8bit, lr=HYPER["lr"], weight_decay=HYPER["weight_decay"])
    opt.load_state_dict(_state_dict())
    for name, p in params.items():
        p.grad = _gradient(name, DATA["steps_before"])
    opt.step()
    theirs = _params(DATA["continued"][0])
    assert float((params["w"].detach() - theirs["w"]).abs().max()) <= TRAJECTORY_TOLERANCE * HYPER["lr"]
