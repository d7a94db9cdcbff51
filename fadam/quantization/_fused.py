"""The fused step of the quantized Adam aliases: dequantize, update and requantize each param in one pass.

``fadam.step(adam8bit(...), params, grads, state, donate=True)`` runs this instead of the chain, and so does the alias'
``update`` (the second kernel then writes the update into a fresh tensor and the codes into copies of the state, so that
``apply_updates`` gives the fused step's params bit for bit). Each quantized leaf is viewed as ``(blocks, block_size)``
rows. float32 and bfloat16 params on the CPU go to a C++ kernel (``_native.py``: one pass per block, about 4x faster
than inductor's code for the kernels below, equal to their eager form bit for bit), all of a step's leaves in one call,
each leaf's ragged last block as its last, shorter row (at 4 bits an even one only). Other rows are processed in
chunks of about 1M elements by two ``torch.compile``-d kernels: the first decodes a chunk's codes and computes the new
float32 moments and each row's new absmax; the second computes the new param and writes the new codes and absmax in
place. The absmax needs the whole row before any code; as one kernel, inductor made that two loops over the rows that
both decoded the codes, while here the second kernel reads the first one's moments back from the cache (8 MB a chunk).
Codes are decoded with one table read each and encoded with an arithmetic first guess and one midpoint read
(``fadam.quantization._maps.encode``); a ragged last block (of these kernels' leaves, or odd at 4 bits) runs the same
math eagerly. The learning rate and bias corrections are 0-d tensors and the row count becomes a dynamic size after the
second shape: at most two compilations of each kernel per (dtype, bits, block size, hyperparameters) serve every param
shape and step. The math and its order are ``quantize_state(scale_by_adam)`` followed by the learning rate and weight
decay, as the chain computes them, except that ATen's CPU lerp rounds a fused multiply-add once where the compiled
kernel rounds twice: about one new m entry in ten differs by an ulp, which rarely moves a code by one step (12 of 16.8M
m codes in one step on random data). Codes are decoded with the map they were stored with; the new m is encoded with the
signed map and the new v with the non-negative one (v >= 0 by construction), where the chain picks from the values (it
may choose the non-negative map for an m that happens to have no negative entry; either decodes). Small leaves
(full-precision state) run the same math: in the C++ kernel's call for float32 moments of float32 or bfloat16 CPU
params, eagerly otherwise, with the step's scalars in float64 where the param or its moments are float64. A donated step
whose leaves all go to the C++ kernel as they are is read and checked in C++ (``_native.read_leaves``), not leaf by leaf
here; any other goes through ``_plan``. Anything else (vmap, autograd, DTensor, AMSGrad, Nesterov, non-contiguous
params, tensor weight decay, an ``update`` without params, a state made for other shapes or another chain) takes the
chain, which refuses a wrong state naming it. Non-contiguous gradients are copied contiguous first.
"""

from __future__ import annotations

import array
import functools
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch._C import _functorch

from fadam._base import FusedStep, ScalarOrSchedule
from fadam._dispatch import PLAIN_TYPES, plain_on_device
from fadam._fused import _advance, _learning_rate, _own_state
from fadam._numerics import bias_correction, bias_correction_number, safe_increment
from fadam._tree import PyTree, check_leaves, tree_flatten
from fadam.quantization import _native as native
from fadam.quantization._codec import (
    QuantizedArray,
    decode_values,
    dequantize_blockwise,
    encode_scaled,
    expected_sizes,
    map_pair,
    quantize_blockwise,
    row_absmax,
    shape_like,
)
from fadam.quantization._maps import MAP_IDS, Tables, map_values, tables_on
from fadam.quantization._wrapper import QuantizedState
from fadam.transforms._adam import ScaleByAdamState


def _moments(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, config: tuple
) -> tuple[torch.Tensor, torch.Tensor]:
    """New (m, v) in the chain's order of operations."""
    b1, b2, _, weight_decay, decoupled, maximize = config
    if maximize:
        g = -g
    if weight_decay and not decoupled:
        g = torch.add(g, p.to(g.dtype), alpha=weight_decay)
    g_m, g_v = g.to(m.dtype), g.to(v.dtype)  # as scale_by_adam: in the moments' dtype (float32 when quantized)
    return m.lerp(g_m, 1 - b1), torch.addcmul(v * b2, g_v, g_v, value=1 - b2)


def _update(
    p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, scalars: tuple[torch.Tensor, ...], config: tuple
) -> torch.Tensor:
    """The chain's final update (after the learning rate and decoupled decay) from the new moments, in p's dtype.
    ``scalars`` = [lr, bc1, bc2_sqrt, decay factor] as 0-d tensors; grads have p's dtype. The factor is the value the
    chain multiplies p by: 1 - lr * weight_decay, or, where that is a tensor (a tensor lr), the same rounded to p's
    dtype (``add_decoupled_weight_decay``). ATen multiplies a low-precision p by a 0-d tensor's float32 value, as by a
    number's."""
    eps, weight_decay, decoupled = config[2:5]
    lr, bc1, bc2_sqrt, factor = scalars[0], scalars[1], scalars[2], scalars[3]
    u = ((m / bc1) / (v.sqrt() / bc2_sqrt + eps)).to(p.dtype) * -lr
    if weight_decay and decoupled:
        u = u - (p - p * factor).to(u.dtype)
    return u.to(p.dtype)


def _rows_moments(
    p: torch.Tensor,
    g: torch.Tensor,
    m_codes: torch.Tensor,
    m_absmax: torch.Tensor,
    m_map: torch.Tensor,  # the 512 values of the map m was stored with (_maps.map_values)
    v_codes: torch.Tensor,
    v_absmax: torch.Tensor,
    v_map: torch.Tensor,
    config: tuple,
    bits: int,
) -> tuple[torch.Tensor, ...]:
    """Kernel 1: the new float32 moments of a chunk of rows and their new absmax. Decodes with the stored maps (a state
    written by the chain may hold m in the non-negative map)."""
    m = decode_values(m_map, m_codes, m_absmax, bits)
    v = decode_values(v_map, v_codes, v_absmax, bits)
    m, v = _moments(p, g, m, v, config)
    return m, v, row_absmax(m), row_absmax(v)


def _rows_finish(
    p: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    m_absmax_new: torch.Tensor,
    v_absmax_new: torch.Tensor,
    m_codes: torch.Tensor,
    m_absmax: torch.Tensor,
    v_codes: torch.Tensor,
    v_absmax: torch.Tensor,
    scalars: tuple[torch.Tensor, ...],
    tables: Tables,
    config: tuple,
    bits: int,
    out: torch.Tensor | None = None,
) -> None:
    """Kernel 2, in place: the new param ``p + u`` into ``p`` (as ``apply_updates`` adds it), or, given ``out``, the
    update ``u`` into ``out`` with ``p`` only read; and the codes of m (signed map) and v (non-negative: v >= 0 by
    construction) for their new absmax."""
    u = _update(p, m, v, scalars, config)
    if out is None:
        p.copy_(p + u)
    else:
        out.copy_(u)
    signed, unsigned = map_pair(bits)
    m_codes.copy_(encode_scaled(m, m_absmax_new, bits, signed, tables))
    v_codes.copy_(encode_scaled(v, v_absmax_new, bits, unsigned, tables))
    m_absmax.copy_(m_absmax_new)
    v_absmax.copy_(v_absmax_new)


# Elements per chunk of rows: the two kernels pass a chunk's float32 moments (8 MB) through the cache, not memory.
_CHUNK = 1 << 20


class Rows(NamedTuple):
    """One leaf's ``(rows, block_size)`` views (codes: ``(rows, block_size * bits / 8)``) and its moments' stored
    maps (512 values each: ``_maps.map_values``): what a row kernel reads, and updates in place."""

    p: torch.Tensor
    g: torch.Tensor
    m_codes: torch.Tensor
    m_absmax: torch.Tensor
    m_map: torch.Tensor
    v_codes: torch.Tensor
    v_absmax: torch.Tensor
    v_map: torch.Tensor


def _rows_step_inplace(
    views: Rows,
    scalars: tuple[torch.Tensor, ...],
    tables: Tables,
    config: tuple,
    bits: int,
    out: torch.Tensor | None = None,
    kernels: tuple[Callable[..., Any], ...] = (_rows_moments, _rows_finish),
) -> None:
    """One step of the row views, in place, chunk by chunk: the new param goes into ``p``, or, given ``out`` (p's
    rows), the update goes there and ``p`` is only read. Two kernels per chunk rather than one: the absmax needs the
    whole row before any code, and one compiled kernel does that as two loops over the rows that both decode the codes
    (four of its six table reads); here the first kernel's moments are reused from the cache."""
    p, g, m_codes, m_absmax, m_map, v_codes, v_absmax, v_map = views
    moments, finish = kernels
    step = max(1, _CHUNK // p.shape[-1])
    for start in range(0, p.shape[0], step):
        rows = slice(start, start + step)
        m, v, m_new_absmax, v_new_absmax = moments(
            p[rows], g[rows], m_codes[rows], m_absmax[rows], m_map, v_codes[rows], v_absmax[rows], v_map, config, bits
        )
        finish(
            p[rows], m, v, m_new_absmax, v_new_absmax, m_codes[rows], m_absmax[rows], v_codes[rows], v_absmax[rows],
            scalars, tables, config, bits, None if out is None else out[rows],
        )  # fmt: skip


_compiled: list[Callable[..., Any]] = []

# Inductor settings for these kernels only. Every index is in range by construction (codes < 512 into 512-entry maps,
# a clamped guess into the padded midpoints), so the per-gather bounds assertions are dropped. A higher read threshold
# keeps values in registers: by default inductor writes the moments to memory between the encoder's many uses and
# reads them back (measured with the one-kernel form on 16M params, one thread: 196 vs 319 ms a step; raising the
# opcount thresholds as well gained 6% more but doubled the compilation time).
_COMPILE_OPTIONS = {"assert_indirect_indexing": False, "realize_reads_threshold": 100}


def _kernel() -> Callable[..., Any]:
    # Compiled functions (the second kernel compiles once per form: the new param in place, or the update into out);
    # hyperparameters reach them as constants (a change recompiles), the lr and bias corrections as 0-d tensors (a
    # change does not). The first chunk shape compiles static kernels; the second shape seen recompiles once with a
    # dynamic row count (torch's automatic dynamic shapes), which then serves all.
    if not _compiled:
        kernels = [
            _with_fallback(torch.compile(f, fullgraph=True, options=_COMPILE_OPTIONS), f)
            for f in (_rows_moments, _rows_finish)
        ]
        _compiled.append(functools.partial(_rows_step_inplace, kernels=tuple(kernels)))
    return _compiled[0]


def _with_fallback(compiled: Callable[..., Any], eager: Callable[..., Any]) -> Callable[..., Any]:
    # A compilation fails before the kernel writes anything (e.g. no C++ compiler): that call and all later ones run
    # the same math eagerly, so no chunk is updated twice. Past dynamo's recompile limit (8 compilations of a kernel:
    # about four sets of hyperparameters, each static then dynamic), fullgraph=True fails instead of running eagerly:
    # the kernels already compiled keep serving their hyperparameters and a new set runs eagerly.
    chosen = [compiled]
    warned = []

    def run(*args: Any) -> Any:
        try:
            return chosen[0](*args)
        except torch._dynamo.exc.BackendCompilerFailed as err:
            warnings.warn(f"fadam: compiling the quantized Adam step failed ({err}); running it eagerly", stacklevel=4)
            chosen[0] = eager
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            if not warned:
                warned.append(True)
                warnings.warn(
                    "fadam: the quantized Adam kernels reached torch._dynamo.config.recompile_limit; new "
                    "hyperparameters run eagerly",
                    stacklevel=4,
                )
        return eager(*args)

    return run


def _with_map(q: QuantizedArray, stored: int | None, map_id: int) -> QuantizedArray:
    """``q`` with ``map_id``, the map its codes are about to be written with. A map id read on the CPU (``stored``,
    the C++ kernel's leaves; ``None`` where it was not read) that already is ``map_id`` is kept: ``q``'s tensors are
    the step's own, donated or copies."""
    if stored == map_id:
        return q
    return q._replace(map_id=torch.full_like(q.map_id, map_id))  # on an accelerator, a kernel: no host sync


# A leaf's route: full-precision state, eagerly or in the C++ kernel; quantized state, in the C++ kernel or the compiled
# kernels
_FULL, _NATIVE_FULL, _NATIVE, _ROWS = range(4)


def _plan(
    p: torch.Tensor, g: torch.Tensor, m: Any, v: Any, bits: int, block_size: int, grad_enabled: bool
) -> tuple[int, int | None, int | None] | None:
    """How the fused step runs a leaf: ``(route, m_id, v_id)``, with the ids of the maps its moments are stored with
    where the C++ kernel takes it (read here, on the CPU), or ``None`` where the chain must (it raises the error that
    names a bad leaf). All that the kernels rely on is checked here, before any leaf is written: plain tensors on the
    param's device, a floating param and its gradient in one dtype, and for quantized moments made for the param's
    shape, uint8 codes and float32 absmax, contiguous, of exactly the param's sizes (the C++ kernel writes through
    their addresses) and 0-d uint8 map ids (on the CPU, ids of known maps)."""
    if not isinstance(p, torch.Tensor) or g is None or p.dtype != g.dtype or not p.is_floating_point():
        return None  # a skipped param (no gradient) or a complex one: the chain
    if not isinstance(m, QuantizedArray):
        if (
            isinstance(v, QuantizedArray)
            or not plain_on_device((p, g, m, v), p, grad_enabled)
            or not m.shape == v.shape == p.shape
        ):
            return None
        native_full = (
            p.is_cpu
            and p.dtype in native.PARAM_DTYPES
            and m.dtype == v.dtype == torch.float32
            and p.is_contiguous()
            and m.is_contiguous()
            and v.is_contiguous()
            and native.available()
        )
        return (_NATIVE_FULL if native_full else _FULL), None, None
    if not isinstance(v, QuantizedArray):
        return None
    m_codes, m_absmax, m_map, _ = m
    v_codes, v_absmax, v_map, _ = v
    if m.shape != p.shape or v.shape != p.shape:
        return None  # the chain raises the error that names the leaf
    if not plain_on_device((p, g, m_codes, m_absmax, m_map, v_codes, v_absmax, v_map), p, grad_enabled):
        return None
    codes, blocks = expected_sizes(p.numel(), bits, block_size)
    if not (
        m_codes.shape == v_codes.shape == (codes,)
        and m_absmax.shape == v_absmax.shape == (blocks,)
        and m_codes.dtype == v_codes.dtype == m_map.dtype == v_map.dtype == torch.uint8
        and m_absmax.dtype == v_absmax.dtype == torch.float32
        and m_map.dim() == v_map.dim() == 0
        and p.is_contiguous()
        and m_codes.is_contiguous()
        and v_codes.is_contiguous()
        and m_absmax.is_contiguous()
        and v_absmax.is_contiguous()
    ):
        return None
    if not p.is_cpu:
        return _ROWS, None, None  # reading the map ids would sync with the device
    m_id, v_id = m_map.item(), v_map.item()
    if not (0 <= m_id < len(MAP_IDS) and 0 <= v_id < len(MAP_IDS)):
        return None
    return (_NATIVE if p.dtype in native.PARAM_DTYPES and native.available() else _ROWS), m_id, v_id


def _targets(p: torch.Tensor, m: Any, v: Any, mode: str) -> tuple[torch.Tensor, Any, Any, torch.Tensor | None]:
    """What a leaf's kernel writes in place: p, m and v (tensors or ``QuantizedArray``s) themselves when donated, else
    copies of the moments, and of p for "copy"; and ``out``, a fresh tensor for the update in mode "update"."""
    if mode != "donate":
        m, v = (_cloned(q) if isinstance(q, QuantizedArray) else q.clone() for q in (m, v))
    if mode == "copy":
        p = p.clone()
    return p, m, v, torch.empty_like(p) if mode == "update" else None


def _cloned(q: QuantizedArray) -> QuantizedArray:
    # `like` holds no data: shared
    return q._replace(codes=q.codes.clone(), absmax=q.absmax.clone(), map_id=q.map_id.clone())


def _split_rows(t: torch.Tensor, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    flat = t.view(-1)
    return flat[: rows * width].view(rows, width), flat[rows * width :].view(1, -1)


def fused_quantized_adam_step(
    *,
    members: int,
    adam_index: int,
    lr: ScalarOrSchedule,
    b1: float,
    b2: float,
    eps: float,
    weight_decay: float | torch.Tensor,
    decoupled: bool,
    maximize: bool,
    bits: int,
    block_size: int,
) -> tuple[FusedStep, Callable[..., tuple[PyTree, PyTree] | None]]:
    """``(fused_step, fused_update)``: ``fused_step(params, grads, state, donate)`` returns ``(new_params,
    new_state)`` and ``fused_update(grads, state, params)`` returns ``(updates, new_state)``, nothing modified, where
    ``apply_updates(params, updates)`` is the fused step's params bit for bit. Either returns ``None`` when the inputs
    need the chain, a state not laid out as the chain of ``members`` transforms leaves it (the quantized Adam state at
    ``adam_index``) included."""
    config = (b1, b2, eps, weight_decay, decoupled, maximize)
    signed, unsigned = map_pair(bits)  # the maps the step writes m and v with

    def fused_step(params: PyTree, grads: PyTree, state: PyTree, donate: bool) -> tuple[PyTree, PyTree] | None:
        return _run(params, grads, state, "donate" if donate else "copy")

    def fused_update(grads: PyTree, state: PyTree, params: PyTree | None) -> tuple[PyTree, PyTree] | None:
        return None if params is None else _run(params, grads, state, "update")

    def _run(params: PyTree, grads: PyTree, state: PyTree, mode: str) -> tuple[PyTree, PyTree] | None:
        # mode: "donate" writes params and state in place; "copy" writes copies; "update" returns the updates
        if isinstance(weight_decay, torch.Tensor) or torch.compiler.is_compiling():
            return None  # while tracing, the chain: its torch ops trace, a ctypes call would break the graph
        if not _own_state(state, members, adam_index, QuantizedState) or not isinstance(
            state[adam_index].inner_state, ScaleByAdamState
        ):
            return None  # a state laid out otherwise: the chain's update refuses it, naming what it expected
        wrapper_state = state[adam_index]
        grad_enabled = torch.is_grad_enabled()
        read = None  # a donated step's leaves, read in C++: (fields, leaves) for native.run_fields
        if mode == "donate":
            read = _read_in_one_call(params, grads, wrapper_state.inner_state, grad_enabled)
        if read is None:
            grad_leaves, param_leaves, spec = check_leaves(grads, params, what="grads")
            mus = spec.flatten_up_to(wrapper_state.inner_state.mu)
            nus = spec.flatten_up_to(wrapper_state.inner_state.nu)
            plans = []
            for p, g, m, v in zip(param_leaves, grad_leaves, mus, nus):
                plan = _plan(p, g, m, v, bits, block_size, grad_enabled)
                if plan is None:
                    return None  # the chain serves these inputs, or raises the error that names the leaf
                plans.append(plan)
        adam_state = wrapper_state.inner_state
        lr_value = _learning_rate(lr, state[adam_index + 1])
        if lr_value is None or (isinstance(lr_value, torch.Tensor) and lr_value.device.type != "cpu"):
            return None  # reading an accelerator lr here would sync; the chain handles it
        count = safe_increment(adam_state.count)
        bc1 = bias_correction_number(b1, count)
        if bc1 is None:
            return None  # a batched or traced count: the chain
        bc2_sqrt = bias_correction(b2, count).sqrt().item()  # torch's sqrt, as the chain's (not always math.sqrt's)
        factor = 1 - lr_value * weight_decay  # the decoupled decay factor, as add_decoupled_weight_decay computes it
        # the chain rounds the decay factor to the param's dtype where it is a tensor (a tensor lr): _update
        rounds_factor = isinstance(factor, torch.Tensor)
        # [lr, bc1, bc2_sqrt, factor, bf16_factor] as numbers (a tensor lr is a plain CPU one): the C++ kernel rounds
        # them to float32 as the torch kernels' 0-d float32 tensors hold them
        bf16_factor = factor.to(torch.bfloat16) if rounds_factor else factor
        numbers = [float(x) for x in (lr_value, bc1, bc2_sqrt, factor, bf16_factor)]
        if read is not None:  # every leaf in the C++ kernel, in place: params and state are the ones given
            native.run_fields(*read, numbers, config, bits)
            return params, _new_state(state, ScaleByAdamState(count, adam_state.mu, adam_state.nu))
        made: dict[tuple[torch.device, torch.dtype, bool], tuple[torch.Tensor, ...]] = {}

        def scalars_for(p: torch.Tensor, *moments: torch.Tensor) -> tuple[torch.Tensor, ...]:
            # [lr, bc1, bc2_sqrt, factor] as 0-d tensors for the torch kernels, made once per param device and dtype
            # and step where a leaf needs them (asynchronously on accelerators): float64 where the param or its
            # full-precision moments are, as the chain computes with the numbers in float64 there (ATen rounds a
            # Python scalar to float32 elsewhere, as it does these); separate tensors: a (4,) one would share its size
            # with a 4-row param and pin it
            wide = any(t.dtype == torch.float64 for t in (p, *moments))
            key = (p.device, p.dtype, wide)
            if key not in made:
                scalars = torch.tensor(numbers[:4], dtype=torch.float64 if wide else torch.float32)
                if rounds_factor:
                    scalars[3] = factor.to(p.dtype)  # exact in float32 (or float64)
                moved = scalars if p.is_cpu else scalars.pin_memory().to(p.device, non_blocking=True)
                made[key] = tuple(moved.unbind())
            return made[key]

        new_params, new_mus, new_nus = [], [], []
        has_native = any(route in (_NATIVE, _NATIVE_FULL) for route, _, _ in plans)
        leaves = native.Leaves(numbers, config, bits, block_size) if has_native else None
        with torch.no_grad():
            for p, g, m, v, (route, m_id, v_id) in zip(param_leaves, grad_leaves, mus, nus, plans):
                if route == _NATIVE_FULL and leaves.takes_full(p):  # recorded; leaves.run() writes it
                    p, m, v, out = _targets(p, m, v, mode)
                    leaves.add_full(p, g.contiguous(), out, m, v)
                    p_new, m_new, v_new = p if out is None else out, m, v
                elif route in (_FULL, _NATIVE_FULL):
                    m_new, v_new = _moments(p, g, m, v, config)
                    u = _update(p, m_new, v_new, scalars_for(p, m, v), config)
                    p_new = u if mode == "update" else p + u
                    if mode == "donate":
                        for target, value in ((p, p_new), (m, m_new), (v, v_new)):
                            target.copy_(value)
                        p_new, m_new, v_new = p, m, v
                else:
                    native_leaves = leaves if route == _NATIVE else None
                    p_new, m_new, v_new = _quantized_leaf(p, g, m, v, m_id, v_id, scalars_for, mode, native_leaves)
                new_params.append(p_new)
                new_mus.append(m_new)
                new_nus.append(v_new)
            if leaves is not None:
                leaves.run()  # the C++ kernel's leaves, all in one call
        new_adam = ScaleByAdamState(count, spec.unflatten(new_mus), spec.unflatten(new_nus))
        return spec.unflatten(new_params), _new_state(state, new_adam)

    def _new_state(state: tuple, new_adam: ScaleByAdamState) -> tuple:
        return tuple(QuantizedState(new_adam) if i == adam_index else _advance(s) for i, s in enumerate(state))

    def _read_in_one_call(
        params: PyTree, grads: PyTree, adam_state: ScaleByAdamState, grad_enabled: bool
    ) -> tuple[array.array, int] | None:
        # A donated step's leaves read and checked in C++ (native.read_leaves), where every one takes the kernel as it
        # is: about 13 us a leaf less than _plan and Leaves. None where any needs those (they then check it again).
        # Python asks only what the shim cannot tell: that each tensor is a plain one autograd need not track, and
        # that no torch.func transform is active (its wrappers are plain-typed).
        if _functorch.maybe_current_level() is not None:
            return None
        param_leaves, spec = tree_flatten(params)
        grad_leaves, grad_spec = tree_flatten(grads)
        if grad_spec != spec:
            return None
        coupled_decay = bool(weight_decay) and not decoupled
        tensors: list[torch.Tensor] = []
        kinds = []  # tensors per leaf: 10 with quantized moments, 4 with float32 ones
        for p, g, m, v in zip(
            param_leaves, grad_leaves, spec.flatten_up_to(adam_state.mu), spec.flatten_up_to(adam_state.nu)
        ):
            quantized = type(m) is QuantizedArray and type(v) is QuantizedArray
            leaf = (p, g, *m, *v) if quantized else (p, g, m, v)
            for t in leaf:
                if type(t) not in PLAIN_TYPES or (grad_enabled and t.requires_grad):
                    return None
            # what the C++ reading would refuse on every step, asked here before it costs the handles
            if (coupled_decay and p.dtype == torch.bfloat16) or (quantized and bits == 4 and p.numel() % 2):
                return None
            tensors += leaf
            kinds.append(len(leaf))
        return native.read_leaves(tensors, kinds, bits, block_size, coupled_decay)

    def _quantized_leaf(p, g, m, v, m_id, v_id, scalars_for, mode, leaves):
        # given `leaves`, the C++ kernel's leaf is only recorded there (its stored maps m_id, v_id); the caller runs
        # them all at once. scalars_for(p): the step's scalars as tensors, for the torch kernels
        p, m, v, out = _targets(p, m, v, mode)  # p is contiguous, and so is out
        rows = p.numel() // block_size
        width = block_size if bits == 8 else block_size // 2
        g = g.contiguous()
        ragged_done = False  # whether the kernel takes the ragged last block too
        if leaves is not None:
            ragged_done = leaves.add(p, g, out, m, v, m_id, v_id)
        elif rows:
            p_rows, g_rows = _split_rows(p, rows, block_size)[0], _split_rows(g, rows, block_size)[0]
            m_rows, v_rows = _split_rows(m.codes, rows, width)[0], _split_rows(v.codes, rows, width)[0]
            tables = tables_on(p.device)
            m_map, v_map = map_values(m.map_id, tables), map_values(v.map_id, tables)  # the stored maps' values
            views = Rows(p_rows, g_rows, m_rows, m.absmax[:rows], m_map, v_rows, v.absmax[:rows], v_map)
            out_rows = None if out is None else _split_rows(out, rows, block_size)[0]
            _kernel()(views, scalars_for(p), tables, config, bits, out=out_rows)
        tail = p.numel() - rows * block_size
        new_m, new_v = _with_map(m, m_id, signed), _with_map(v, v_id, unsigned)  # the codes and absmax of m and v
        if tail and not ragged_done:  # the ragged last block, eagerly, with the same math and the codec's padding
            p_tail, g_tail = p.view(-1)[rows * block_size :], g.reshape(-1)[rows * block_size :]
            like = shape_like((tail,), p.device)
            m_tail, v_tail = (QuantizedArray(q.codes[rows * width :], q.absmax[rows:], q.map_id, like) for q in (m, v))
            m_full = dequantize_blockwise(m_tail, bits=bits, block_size=block_size)
            v_full = dequantize_blockwise(v_tail, bits=bits, block_size=block_size)
            m_full, v_full = _moments(p_tail, g_tail, m_full, v_full, config)
            u = _update(p_tail, m_full, v_full, scalars_for(p), config)
            if out is None:
                p_tail.add_(u)  # as the kernel: p + u
            else:
                out.view(-1)[rows * block_size :].copy_(u)
            for old, full, map_id in ((m_tail, m_full, new_m.map_id), (v_tail, v_full, new_v.map_id)):
                new = quantize_blockwise(full, bits, block_size, map_id=map_id)
                old.codes.copy_(new.codes)
                old.absmax.copy_(new.absmax)
        return p if out is None else out, new_m, new_v

    return fused_step, fused_update
