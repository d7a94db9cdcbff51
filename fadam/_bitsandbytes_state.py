"""bitsandbytes' Adam state (``Adam8bit``, ``AdamW8bit``, ``PagedAdam8bit``, ``PagedAdamW8bit``, and the 32-bit
``Adam``/``AdamW`` family) as torch.optim.Adam's per-param state, and back: the format behind
``fadam.state_from_torch`` and ``fadam.state_to_torch`` for bitsandbytes (which fadam does not import).

Per param, bitsandbytes keeps ``step`` (an int) and the first and second moments as ``state1`` and ``state2``, shaped
like the param. Where the param has at least ``min_8bit_size`` elements (4096 by default) they are 8-bit: ``state1``
and ``state2`` are uint8 codes, ``qmap1`` and ``qmap2`` the 256 sorted values the codes index (the signed dynamic map
for the first moment, the unsigned one for the second), and ``absmax1`` and ``absmax2`` one float32 scale per block of
256 consecutive elements of the flattened param (the last block shorter): element ``i`` stands for
``qmap[code_i] * absmax[i // 256]``. Smaller params keep float32 ``state1`` and ``state2``. The optimizer's own state
holds these keys as they are; its ``state_dict`` moves every key but ``step`` into a nested dict under
``"__bnb_optimizer_quant_state__"`` (so that FSDP does not gather them), which its ``load_state_dict`` unpacks. Both
are read; the ``state_dict`` layout is written. Its other optimizers (Lion, LAMB, AdEMAMix, the one-state ones) keep
other keys or shapes and are refused.

bitsandbytes' Adam classes decay weights decoupled, as AdamW (``p *= 1 - lr * weight_decay``), ``Adam8bit`` too: a
run continues in ``fadam.adamw8bit`` (or ``fadam.adamw``) with bitsandbytes' ``weight_decay``.
"""

from __future__ import annotations

from typing import Any

import torch

from fadam.quantization._codec import _blocks

__all__ = ["adam_stand_in", "as_bitsandbytes", "as_torch_adam", "dynamic_map", "is_bitsandbytes"]

BLOCK = 256  # bitsandbytes' block size of 8-bit optimizer state
_WRAPPED = "__bnb_optimizer_quant_state__"
_FULL_KEYS = frozenset({"step", "state1", "state2"})
_EIGHT_BIT_KEYS = _FULL_KEYS | {"qmap1", "qmap2", "absmax1", "absmax2"}


def dynamic_map(signed: bool) -> torch.Tensor:
    """bitsandbytes' 8-bit dynamic map: 256 sorted float32 values.

    Decade ``k`` of seven (``k = 0`` the smallest) spans ``(0.1, 1] * 10**(k - 6)`` and holds the midpoints of its
    ``2**k`` equal steps (``2**(k + 1)`` for the unsigned map), mirrored to negative values for the signed map; 0 and
    1 complete it. Computed in float32 as bitsandbytes computes it, so the values are its own bit for bit.

    Example:
        >>> from fadam._bitsandbytes_state import dynamic_map
        >>> m = dynamic_map(signed=True)
        >>> m.numel(), float(m[0]), float(m[-1]), float(m[-2])
        (256, -0.992968738079071, 1.0, 0.992968738079071)

    References:
        Dettmers et al., "8-bit Optimizers via Block-wise Quantization", ICLR 2022.
    """
    values = [torch.zeros(1), torch.ones(1)]
    for k in range(7):
        edges = torch.linspace(0.1, 1.0, (2**k if signed else 2 ** (k + 1)) + 1, dtype=torch.float32)
        midpoints = (edges[:-1] + edges[1:]) / 2 * 10.0 ** (k - 6)
        values += [midpoints, -midpoints] if signed else [midpoints]
    return torch.cat(values).sort().values


def _decoded(codes: torch.Tensor, qmap: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """The float32 values of 8-bit ``codes`` (any shape) under ``qmap`` and the scales of their blocks."""
    n = codes.numel()
    values = _blocks(qmap.float()[codes.reshape(-1).long()], BLOCK) * absmax.float().unsqueeze(-1)
    return values.reshape(-1)[:n].reshape(codes.shape)


def _encoded(values: torch.Tensor, qmap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, absmax)`` of float32 ``values`` under ``qmap``: each block scaled by its largest magnitude and each
    element rounded to the nearest value of the map."""
    n = values.numel()
    blocks = _blocks(values.reshape(-1).float(), BLOCK)
    absmax = blocks.abs().amax(dim=-1)
    scaled = (blocks * torch.where(absmax > 0, absmax, 1.0).reciprocal().unsqueeze(-1)).clamp(-1.0, 1.0)
    codes = torch.bucketize(scaled, (qmap[:-1] + qmap[1:]) / 2).to(torch.uint8)
    return codes.reshape(-1)[:n].reshape(values.shape), absmax


# --- into fadam: bitsandbytes' entries as torch.optim.Adam's ----------------------------------------------------------


def _is_entry(entry: dict[str, Any]) -> bool:
    return "state1" in entry or _WRAPPED in entry


def _moment(entry: dict[str, Any], number: int, param: torch.Tensor, where: str) -> torch.Tensor:
    """Moment ``number`` (1 or 2) of a bitsandbytes entry, as float32 values shaped like ``param``."""
    state = entry[f"state{number}"]
    if not isinstance(state, torch.Tensor) or state.shape != param.shape:
        found = tuple(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__
        raise ValueError(
            f"{where}: state{number} is {found}, expected a tensor of the param's shape {tuple(param.shape)}"
        )
    if state.dtype != torch.uint8:
        return state.float()
    qmap, absmax = entry[f"qmap{number}"], entry[f"absmax{number}"]
    if qmap.numel() != 256 or absmax.numel() != -(-param.numel() // BLOCK):
        raise ValueError(
            f"{where}: qmap{number} has {qmap.numel()} values and absmax{number} {absmax.numel()} scales, expected 256 "
            f"and one per block of {BLOCK} elements ({-(-param.numel() // BLOCK)})"
        )
    return _decoded(state, qmap, absmax)


def _adam_entry(entry: dict[str, Any], param: torch.Tensor, where: str) -> dict[str, Any]:
    flat = {**{k: v for k, v in entry.items() if k != _WRAPPED}, **entry.get(_WRAPPED, {})}
    state1 = flat.get("state1")
    expected = _EIGHT_BIT_KEYS if isinstance(state1, torch.Tensor) and state1.dtype == torch.uint8 else _FULL_KEYS
    if set(flat) != expected:
        raise ValueError(
            f"{where}: expected the keys of bitsandbytes' Adam state {sorted(expected)}, found {sorted(flat)} (its "
            "Adam, AdamW, Adam8bit, AdamW8bit and paged variants convert; Lion, LAMB, AdEMAMix and the one-state "
            "optimizers do not)"
        )
    m, v = (_moment(flat, number, param, where) for number in (1, 2))
    return {"step": flat["step"], "exp_avg": m, "exp_avg_sq": v}


def as_torch_adam(
    per_param: list[dict[str, Any]], params: list[torch.Tensor], paths: list[str]
) -> list[dict[str, Any]]:
    """Each bitsandbytes entry of ``per_param`` (the state of each of ``params``) as torch.optim.Adam's: ``step``,
    ``exp_avg`` and ``exp_avg_sq`` (float32); other entries as they are.

    Example:
        >>> import torch
        >>> from fadam._bitsandbytes_state import as_torch_adam
        >>> entry = {"step": 2, "state1": torch.full((2,), 0.5), "state2": torch.full((2,), 0.25)}
        >>> as_torch_adam([entry], [torch.zeros(2)], ["[0]"])[0]["exp_avg"]
        tensor([0.5000, 0.5000])
    """
    return [
        _adam_entry(entry, p, f"bitsandbytes state of param {path}") if _is_entry(entry) else entry
        for entry, p, path in zip(per_param, params, paths)
    ]


# --- out of fadam: torch.optim.Adam's entries as bitsandbytes' -------------------------------------------------------


def is_bitsandbytes(optimizer: Any) -> bool:
    """Whether ``optimizer`` is one of bitsandbytes' (recognised by its class's module: fadam does not import it)."""
    return type(optimizer).__module__.partition(".")[0] == "bitsandbytes"


def adam_stand_in(optimizer: torch.optim.Optimizer) -> torch.optim.Adam:
    """A torch.optim.Adam over the param groups of ``optimizer``, one of bitsandbytes' Adam family: its state holds
    the same moments, under torch.optim.Adam's keys."""
    if getattr(optimizer, "optimizer_name", None) != "adam":
        raise ValueError(
            "state_to_torch converts into bitsandbytes' Adam family (Adam8bit, AdamW8bit, PagedAdam8bit, "
            f"PagedAdamW8bit, Adam, AdamW), not {type(optimizer).__name__}"
        )
    return torch.optim.Adam([{"params": group["params"]} for group in optimizer.param_groups])


def _bitsandbytes_entry(entry: dict[str, Any], param: torch.Tensor, config: dict[str, Any], where: str) -> dict:
    if config["max_unorm"] > 0:
        raise ValueError(f"{where}: bitsandbytes' max_unorm clips the update's norm, which fadam's Adam does not")
    m, v = (entry[key].detach().to(param.device, torch.float32, copy=True) for key in ("exp_avg", "exp_avg_sq"))
    if config["optim_bits"] != 8 or param.numel() < config["min_8bit_size"]:  # as bitsandbytes' init_state decides
        return {"step": int(entry["step"]), _WRAPPED: {"state1": m, "state2": v}}
    quantized = {}
    for number, moment, signed in ((1, m, True), (2, v, False)):
        if not bool(torch.isfinite(moment).all()):
            raise ValueError(f"{where}: a moment holds inf or nan, which bitsandbytes' 8-bit state cannot")
        qmap = dynamic_map(signed).to(param.device)
        codes, absmax = _encoded(moment, qmap)
        quantized.update({f"state{number}": codes, f"qmap{number}": qmap, f"absmax{number}": absmax})
    return {"step": int(entry["step"]), _WRAPPED: quantized}


def as_bitsandbytes(adam_state_dict: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``adam_state_dict``, made for ``adam_stand_in(optimizer)``, as a ``state_dict`` that ``optimizer`` loads:
    8-bit moments (encoded to the nearest value of bitsandbytes' maps) where its configuration for the param says
    so (``optim_bits`` 8 and at least ``min_8bit_size`` elements), float32 ones elsewhere."""
    places = [(gi, pi, group) for gi, group in enumerate(optimizer.param_groups) for pi in range(len(group["params"]))]
    state = {}
    for index, entry in adam_state_dict["state"].items():
        gi, pi, group = places[index]
        config = optimizer.get_config(gi, pi, group)  # type: ignore[attr-defined]
        where = f"param group {gi}, param {pi}"
        state[index] = _bitsandbytes_entry(entry, group["params"][pi], config, where)
    return {"state": state, "param_groups": optimizer.state_dict()["param_groups"]}
