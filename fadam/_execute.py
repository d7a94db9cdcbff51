"""Running a program: the backend each group of leaves takes, and ``explain``, which says so.

A program (``fadam._program``) is cut into segments: a run of declared stages, where a stage with a reduction starts
a new one unless it comes first (its reduction reads the segment's input, which must exist for every leaf), or one
opaque stage. A masked stage (``masked``, ``partition``) applies to the leaves its mask selects; within a segment,
leaves are grouped by the stages that apply to them, and each group runs those. ``fadam.step`` runs each segment:

- *torch's fused kernel* (``fadam._torch_kernels``), where the program is one segment and a group's stages are one of
  the chains it computes, on the leaves ``torch_ready`` admits (CPU or CUDA): one call per device and dtype;
- *generated kernel*: one call per group and device for all the leaves that may take it, the C++ one
  (``fadam._cpu_kernel``) for CPU leaves and the Triton one (``fadam._triton_kernel``) for CUDA leaves: plain
  tensors that autograd does not record, contiguous, float32, float64 or bfloat16 (complex ones as pairs of reals),
  with the gradient in the param's dtype (quantized slots: of real params); the last segment also adds the update
  to the param;
- *eager*: the declarations' bodies on torch ops, for the other leaves, and every leaf of an opaque stage.

``torch_ready`` and ``ready`` decide, leaf by leaf, and ``refusal`` gives the reason a leaf does not take the
generated kernel. A
donated step's aliasing is checked before (``fadam.step``), for all leaves at once.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any, NamedTuple

import optree
import torch
from torch._C._functorch import is_functorch_wrapped_tensor as _functorch_wrapped
from torch._C._functorch import maybe_current_level as _current_level

from fadam import _triton_kernel
from fadam._base import add_update
from fadam._compiled_checks import compiled_checks
from fadam._cpu_kernel import KERNEL_DTYPES, Kernel, Quantized, _aten_fma, load, unbuildable, weight_scalars
from fadam._dispatch import FUSED_DTYPES, PLAIN_TYPES, functorch_wrapped, is_plain, overlap_in_leaves, real_view
from fadam._numerics import device_vector, is_resident
from fadam._program import (
    Elementwise,
    Program,
    Slot,
    Stage,
    Storage,
    eager_stage,
    leaf_selection,
    leaf_statistics,
    program_of,
    scalar_values,
    state_at,
    trace,
    with_state_at,
)
from fadam._sparse import check_sparse
from fadam._torch_kernels import shape_of, torch_kernel
from fadam._tree import PyTree, _order_like, check_leaves, tree_leaves, tree_paths
from fadam.combinators._masking import _select
from fadam.quantization._codec import QuantizedArray, dequantize_blockwise, expected_sizes, quantize_blockwise, slot_map

Leaves = list[torch.Tensor | None]
Checked = tuple[list[Any], list[Any], Any]  # check_leaves' result: the grads' and params' leaves, the params' spec
Written = dict[int, bytes]  # data pointer of a slot leaf written into ``into`` -> its 16 Fletcher sums, as in memory

BACKENDS = ("auto", "eager", "kernel", "triton")
_STRIDED = torch.strided
_CPU = torch.device("cpu")
_backend: ContextVar[str] = ContextVar("fadam_backend", default="auto")


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    """Runs the steps and updates inside the block on one backend: ``"auto"`` (the default: torch's fused kernel
    where a group's stages are one of its chains, else the generated kernel where the leaves allow it, else eager),
    ``"eager"`` (torch ops only: the reference), ``"kernel"`` (the generated kernel where the leaves allow it, C++ on
    the CPU and Triton on CUDA, never torch's fused kernels) or ``"triton"`` (the generated Triton kernel for every
    leaf it can run: CUDA leaves, and CPU leaves when ``TRITON_INTERPRET=1`` has Triton's interpreter run them, which
    is slow but shows on any machine what a GPU computes). The choice holds for the current thread (and task) only.

    Example:
        >>> import torch, fadam
        >>> tx = fadam.lion(1e-3)
        >>> params = {"w": torch.ones(3)}
        >>> with fadam.backend("eager"):
        ...     new_params, state = fadam.step(tx, params, {"w": torch.ones(3)}, tx.init(params))
        >>> new_params["w"]
        tensor([0.9990, 0.9990, 0.9990])
    """
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    token = _backend.set(name)
    try:
        yield
    finally:
        _backend.reset(token)


class Segment(NamedTuple):
    stages: tuple[Stage, ...]

    @property
    def opaque(self) -> bool:
        return self.stages[0].decl is None

    @property
    def storage(self) -> Storage | None:
        """The storage of the segment's quantized slots (one per segment), if any stage has one."""
        return next((s.storage for s in self.stages if s.storage is not None and s.decl.slots), None)


def _storage_changes(current: list[Stage], stage: Stage) -> bool:
    if not stage.decl.slots or stage.storage is None:
        return False
    held = Segment(tuple(current)).storage if current else None
    return held is not None and held != stage.storage


def segments(program: Program) -> list[Segment]:
    found: list[Segment] = []
    current: list[Stage] = []
    for stage in program.stages:
        if stage.decl is None or (current and (stage.decl.reduces or _storage_changes(current, stage))):
            if current:
                found.append(Segment(tuple(current)))
            current = []
        if stage.decl is None:
            found.append(Segment((stage,)))
        else:
            current.append(stage)
    if current:
        found.append(Segment(tuple(current)))
    return found


_KERNEL_PARAM_DTYPES = frozenset({*KERNEL_DTYPES, torch.complex64, torch.complex128})


def generated_route(device: torch.device) -> str | None:
    """Which generated kernel runs leaves on ``device`` under the current ``fadam.backend``: ``"cpu"`` (C++),
    ``"triton"``, or ``None`` (none: they run eagerly)."""
    if _backend.get() == "triton":
        return "triton" if _triton_kernel.runs_on(device) else None
    if device.type == "cpu":
        return "cpu"
    return "triton" if device.type == "cuda" and _triton_kernel.runs_on(device) else None


def ready(
    p: torch.Tensor, u: torch.Tensor | None, slots: list[Any], grad_enabled: bool, storage: Storage | None = None
) -> bool:
    """Whether a leaf can take the generated kernel (``refusal`` says why not): the per-leaf check of every step,
    kept to one expression per tensor. The caller checks that torch.compile is not tracing."""
    if u is None:
        return False
    dtype = p.dtype
    zero_dim = p.dim() == 0
    if dtype not in _KERNEL_PARAM_DTYPES or (zero_dim and dtype is not torch.float64):
        return False
    on_cpu = p.is_cpu and _backend.get() != "triton"  # the C++ kernel's leaves: the common case, checked quickly
    device = None if on_cpu else p.device
    if not on_cpu and generated_route(device) is None:
        return False
    checks = compiled_checks()
    if checks is not None:  # the common cases of the loop below: every tensor of the param's dtype, or quantized
        sizes = _quantized_sizes(p, storage, device) if storage is not None and not zero_dim else None
        codes, scales = (-1, -1) if sizes is None else sizes
        if checks.leaf_ready([p, u, *slots], dtype, _CPU if on_cpu else device, grad_enabled, codes, scales):
            return True
    wrapped = _wrapped_check()
    # a real param's slots may hold another floating dtype (float32 moments of bfloat16 params); a complex one's
    # are complex like it, and a 0-d one's float64 (its float64 0-d scalars would promote any other dtype)
    slot_dtypes = (dtype,) if zero_dim or p.is_complex() else KERNEL_DTYPES
    sizes = None  # the quantized slots' codes and absmax lengths, the same for each of the leaf's slots
    for number, tensor in enumerate((p, u, *slots)):
        if type(tensor) is QuantizedArray:
            if zero_dim:
                return False
            if sizes is None:
                sizes = _quantized_sizes(p, storage, device)
            if sizes is None or not _quantized_placed(tensor, sizes, grad_enabled, wrapped, device):
                return False
            continue
        if (
            not _walkable(tensor, grad_enabled, wrapped)
            or (tensor.dtype is not dtype and (number < 2 or tensor.dtype not in slot_dtypes))
            or not (tensor.is_cpu if on_cpu else tensor.device == device)
        ):
            return False
    return True


def _wrapped_check() -> Any:
    """``torch.func``'s check of a wrapped tensor, or ``None`` outside its transforms, where no tensor is wrapped (asked
    once a leaf, not once a tensor)."""
    return _functorch_wrapped if _current_level() is not None else None


def _walkable(tensor: Any, grad_enabled: bool, wrapped: Any) -> bool:
    """A plain dense contiguous tensor that autograd does not record and ``torch.func`` does not wrap: what a kernel
    may walk as a flat array."""
    return (
        type(tensor) in PLAIN_TYPES
        and tensor.layout is _STRIDED
        and not (grad_enabled and tensor.requires_grad)
        and tensor.is_contiguous()
        and not (wrapped is not None and wrapped(tensor))
    )


_UINT8, _FLOAT32 = torch.uint8, torch.float32


def _quantized_ready(
    q: QuantizedArray, p: torch.Tensor, storage: Storage | None, grad_enabled: bool, device: torch.device | None
) -> bool:
    """Whether a quantized slot leaf can take the kernel: of a real param, its codes, absmax and map id plain
    contiguous tensors of the sizes ``storage`` gives for the param, on the CPU for the C++ kernel (``device``
    ``None``), else on ``device``, in blocks that the Triton kernel takes."""
    sizes = _quantized_sizes(p, storage, device)
    return sizes is not None and _quantized_placed(q, sizes, grad_enabled, _wrapped_check(), device)


def _quantized_sizes(p: torch.Tensor, storage: Storage | None, device: torch.device | None) -> tuple[int, int] | None:
    """The lengths of the codes and absmax of a quantized slot of ``p`` that the kernel takes, or ``None`` where it
    takes none (``_quantized_ready``)."""
    if storage is None or p.dtype not in KERNEL_DTYPES:
        return None
    if device is not None and not _triton_kernel.takes_blocks(storage.bits, storage.block):
        return None
    return expected_sizes(p.numel(), storage.bits, storage.block)


def _quantized_placed(
    q: QuantizedArray, sizes: tuple[int, int], grad_enabled: bool, wrapped: Any, device: torch.device | None
) -> bool:
    """``_quantized_ready`` for codes and absmax of the lengths ``sizes``, one expression per tensor (it runs for
    every quantized slot of every step). Codes and map id are integers, which autograd never records."""
    codes, absmax, map_id = q[0], q[1], q[2]
    if device is None:
        return (
            type(codes) in PLAIN_TYPES
            and codes.layout is _STRIDED
            and codes.dtype is _UINT8
            and codes.is_contiguous()
            and codes.dim() == 1
            and codes.numel() == sizes[0]
            and codes.is_cpu
            and _walkable(absmax, grad_enabled, wrapped)
            and absmax.dtype is _FLOAT32
            and absmax.dim() == 1
            and absmax.numel() == sizes[1]
            and absmax.is_cpu
            and type(map_id) in PLAIN_TYPES
            and map_id.layout is _STRIDED
            and map_id.dtype is _UINT8
            and map_id.dim() == 0
            and map_id.is_cpu
            and not (wrapped is not None and (wrapped(codes) or wrapped(map_id)))
        )
    return all(
        _walkable(tensor, grad_enabled, wrapped)
        and tensor.dtype is dtype
        and tensor.dim() == dims
        and tensor.numel() == size
        and tensor.device == device
        for tensor, dtype, dims, size in (
            (codes, _UINT8, 1, sizes[0]),
            (absmax, _FLOAT32, 1, sizes[1]),
            (map_id, _UINT8, 0, 1),
        )
    )


# the leaf dtypes whose reals torch's fused kernels take (a complex leaf runs as its real view)
_TORCH_KERNEL_LEAF_DTYPES = frozenset({*FUSED_DTYPES, torch.complex32, torch.complex64, torch.complex128})


def torch_ready(p: torch.Tensor, u: torch.Tensor | None, slots: list[Any], grad_enabled: bool) -> bool:
    """Whether a leaf can take one of torch's fused kernels (``fadam._torch_kernels``): the param, its update and its
    slots plain contiguous tensors of one dtype that the kernels take, on one CPU or CUDA device, that autograd does not
    record. The kernels walk each leaf's tensors as flat arrays of one layout, so a strided view would be written past
    its elements."""
    return torch_place(p, u, slots, grad_enabled) is not None


def torch_place(
    p: torch.Tensor, u: torch.Tensor | None, slots: list[Any], grad_enabled: bool
) -> tuple[torch.device, torch.dtype] | None:
    """The device and dtype of a leaf that can take torch's fused kernels (``torch_ready``), else ``None``."""
    if u is None or QuantizedArray in map(type, slots):  # quantized state (quantize_state's): torch's kernels take none
        return None
    dtype = p.dtype
    if dtype not in _TORCH_KERNEL_LEAF_DTYPES:
        return None
    on_cpu = p.is_cpu
    device = _CPU if on_cpu else p.device
    if not on_cpu and device.type != "cuda":
        return None
    return (device, dtype) if _placed([*slots, p, u], device, dtype, grad_enabled) else None


def _placed(tensors: list[Any], device: torch.device, dtype: torch.dtype, grad_enabled: bool) -> bool:
    """Whether ``tensors`` are all walkable (``_walkable``) tensors of ``dtype`` on ``device``, in one pass (in C++
    where the extension of ``fadam._compiled_checks`` is loaded)."""
    checks = compiled_checks()
    if checks is not None:
        return checks.placed(tensors, dtype, device, grad_enabled)
    return placed_in_python(tensors, device, dtype, grad_enabled)


def placed_in_python(tensors: list[Any], device: torch.device, dtype: torch.dtype, grad_enabled: bool) -> bool:
    """``_placed`` without the extension."""
    wrapped = _wrapped_check()
    if device.type == "cpu":
        return all(_walkable(t, grad_enabled, wrapped) and t.dtype is dtype and t.is_cpu for t in tensors)
    return all(_walkable(t, grad_enabled, wrapped) and t.dtype is dtype and t.device == device for t in tensors)


def refusal(
    p: torch.Tensor, u: torch.Tensor | None, slots: list[Any], grad_enabled: bool, storage: Storage | None = None
) -> str | None:
    """Why a leaf cannot take the generated kernel, or ``None`` if it can (``ready``)."""
    if torch.compiler.is_compiling():
        return "traced by torch.compile"
    if ready(p, u, slots, grad_enabled, storage):
        return None
    if u is None:
        return "no gradient"
    route = generated_route(p.device)
    if route is None:
        return _no_route(p.device)
    quantized = [slot for slot in slots if type(slot) is QuantizedArray]
    if quantized and p.is_complex():
        return f"quantized state of a {p.dtype} param"
    device = None if route == "cpu" else p.device
    if quantized and device is not None and storage and not _triton_kernel.takes_blocks(storage.bits, storage.block):
        return f"quantized state in blocks of {storage.block} elements, more than a Triton program holds"
    if any(not _quantized_ready(q, p, storage, grad_enabled, device) for q in quantized):
        return f"its quantized state is not laid out as quantize_state lays it out on {p.device}"
    slots = [slot for slot in slots if type(slot) is not QuantizedArray]
    for tensor in (p, u, *slots):
        if type(tensor) not in PLAIN_TYPES:
            return f"a {type(tensor).__name__}, not a plain tensor"
        if tensor.layout != torch.strided:
            return f"a {tensor.layout} tensor"
        if tensor.device != p.device:
            return f"a tensor on {tensor.device}, its param on {p.device}"
        if not is_plain(tensor):
            return "autograd or torch.func records it" if tensor.requires_grad else "wrapped by torch.func"
        if not tensor.is_contiguous():
            return "not contiguous"
    dtype = real_view(p).dtype
    if p.dim() == 0 and dtype != torch.float64:
        return "a 0-d leaf, which computes with float64 scalars"
    if p.dim() == 0 and (quantized or any(t.dtype != dtype for t in slots)):
        return "a 0-d leaf with state of another dtype (its float64 scalars promote it)"
    if dtype not in KERNEL_DTYPES:
        return f"{p.dtype} (the kernel takes float32, float64 and bfloat16)"
    return "its gradient has another dtype than the param, or its state a dtype the kernel does not take"


def _no_route(device: torch.device) -> str:
    """Why no generated kernel runs leaves on ``device``."""
    if _backend.get() == "triton":
        if device.type == "cpu":
            return "on the CPU, where Triton runs only under TRITON_INTERPRET=1 (its interpreter)"
        return f"on {device}, where Triton does not run" if _triton_kernel.installed() else "Triton is not installed"
    if device.type == "cuda":
        return "on cuda, where the generated kernel is Triton's, which is not installed"
    return f"on {device}, where no kernel is generated"


def _graph_scalar(value: Any, grad_enabled: bool) -> bool:
    """Whether a scalar is a tensor that autograd or ``torch.func`` must see: the segment then runs eagerly."""
    if not isinstance(value, torch.Tensor):
        return False
    return functorch_wrapped(value) or (grad_enabled and value.requires_grad)


class _StageLeaves(NamedTuple):
    """A declared stage's leaves: which of the params' leaves it applies to, and its slots' leaves over those."""

    selected: list[bool]
    slots: list[list[torch.Tensor]]  # per slot, one leaf per selected param leaf
    position: list[int | None]  # per param leaf, its index in the slot lists
    spec: Any  # the slots' tree structure
    statistics: list[list[torch.Tensor]]  # per statistic (``Statistic``), as ``slots``


def _stage_leaves(
    program: Program, state: Any, params: PyTree, param_leaves: list[Any], spec: Any
) -> dict[int, _StageLeaves] | None:
    """Each declared stage's leaves, or ``None`` where a state is not laid out as its stage's ``init`` lays it out
    (another type, an OrderedDict of the params' dict...): the eager path then matches it or names the problem.
    ``param_leaves``: the leaves of ``params`` in the order of ``spec``. Keyed by ``id(stage)``: the stages of one
    transform may share its state (``Elementwise.shares_count``), and so a path."""
    found = {}
    everything = [True] * len(param_leaves)
    every_position: list[int | None] = list(range(len(param_leaves)))
    for stage in program.stages:
        if stage.decl is None:
            continue
        stage_state = state_at(state, stage.path)
        if not isinstance(stage_state, stage.decl.state_type):
            return None
        trees = [getattr(stage_state, slot.name) for slot in stage.decl.slots]
        if stage.selections:
            selected = leaf_selection(stage, params)
            like = optree.tree_structure(_select(params, selected), none_is_leaf=True)
            positions: list[int | None] = []
            count = 0
            for flag in selected:
                positions.append(count if flag else None)
                count += flag
            references = [leaf for leaf, keep in zip(param_leaves, selected) if keep]
        else:  # no mask: every leaf, in the params' order
            selected, like, positions, references = everything, spec, every_position, param_leaves
        slots = [_slot_leaves(tree, like) for tree in trees]
        if any(slot is None for slot in slots):
            return None
        if not _all_in_place(slots, references):
            return None
        statistics = [_slot_leaves(getattr(stage_state, st.name), like) for st in stage.decl.statistics]
        if any(leaves is None or any(_sharded_codes(t) for t in leaves) for leaves in statistics):
            return None
        found[id(stage)] = _StageLeaves(selected, slots, positions, like, statistics)
    return found


def _sharded_codes(leaf: Any) -> bool:
    """Whether ``leaf`` is a quantized statistic of a DTensor param, which the transform's own update decodes."""
    return type(leaf) is QuantizedArray and not is_plain(leaf.codes)


def _slot_leaves(tree: PyTree, like: Any) -> list[Any] | None:
    """A slot tree's leaves in the order of ``like`` (the params' structure), where it is the same tree or differs
    only in its kinds of mapping (a state made from a dict, params given as an OrderedDict); else ``None``."""
    leaves, spec = optree.tree_flatten(tree, is_leaf=_is_slot_leaf, none_is_leaf=True)
    if spec == like:
        return leaves
    order = _order_like(spec, like)
    return None if order is None else [leaves[i] for i in order]


def _is_slot_leaf(node: Any) -> bool:
    """A quantized slot leaf, or a tensor (``is_tensor_leaf``)."""
    return type(node) is QuantizedArray or isinstance(node, torch.Tensor)


def _all_in_place(slots: list[list[Any]], references: list[Any]) -> bool:
    """Whether every slot leaf has its param's (or update's) shape and device (``_same_place``), in C++ where the
    extension of ``fadam._compiled_checks`` is loaded and the leaves are plain tensors."""
    checks = compiled_checks()
    if checks is not None and checks.same_places(slots, references):
        return True
    return all(_same_place(s, r) for slot in slots for s, r in zip(slot, references))


def _same_place(slot: Any, reference: Any) -> bool:
    """Whether a slot leaf has its param's (or update's) shape and device, as its ``init`` made it."""
    if isinstance(slot, torch.Tensor) and isinstance(reference, torch.Tensor):  # the common case, checked first
        return slot.shape == reference.shape and ((slot.is_cpu and reference.is_cpu) or slot.device == reference.device)
    if type(slot) is QuantizedArray and isinstance(reference, torch.Tensor):
        codes = slot.codes
        same_device = (codes.is_cpu and reference.is_cpu) or codes.device == reference.device
        return same_device and slot.shape == reference.shape
    return reference is None or slot is None  # a leaf with no param (or update) takes any slot; else none is there


class _Step(NamedTuple):
    """What a step reads and writes, leaf by leaf, as the segments run."""

    params: Leaves
    updates: Leaves  # the current updates; None once applied to the param
    new_params: Leaves
    applied: list[bool]
    leaves: dict[int, _StageLeaves]
    into: dict[int, _StageLeaves] | None  # where the new slots go (``run_step``'s ``into``), else None
    sums: Written | None  # ``run_step``'s ``sums``
    # leaf -> the update a kernel wrote into a new tensor this step: a later kernel may write over it
    owned: dict[int, torch.Tensor]


def run_step(
    program: Program,
    params: PyTree,
    grads: PyTree,
    state: PyTree,
    donate: bool,
    into: PyTree | None = None,
    checked: Checked | None = None,
    sums: Written | None = None,
) -> tuple[PyTree, PyTree] | None:
    """One step of ``program`` with the generated kernel where leaves allow it, or ``None`` when no leaf can take it
    (the caller then runs ``update`` and ``apply_updates``). State of another layout also gives ``None``, so that the
    transforms' own checks name what they expected. ``into``: a state laid out as ``state`` whose slot leaves take
    the new slots where the generated kernel computes them (it reads ``state`` and writes there: no copy; torch's
    fused kernels, which update in place, then do not run); the returned state holds them. ``checked``: the caller's
    ``check_leaves(grads, params, what="grads")``, which is then not run again. ``sums``: where the C++ kernel,
    writing slot leaves into ``into``, puts each one's Fletcher sums (``fadam.paging._checksum.leaf_sums``'s 16
    numbers, their bytes as in memory) by its data pointer; a slot leaf written otherwise is not there."""
    ran = _run(program, grads, state, params, donate, applies=True, into=into, checked=checked, sums=sums)
    if ran is None:
        return None
    step, state, spec = ran
    for i, (p, u) in enumerate(zip(step.params, step.updates)):
        if step.applied[i] or u is None:
            continue
        step.new_params[i] = add_update(p, u, in_place=donate and is_plain(p) and is_plain(u))
    return spec.unflatten(step.new_params), state


def run_update(
    program: Program,
    updates: PyTree,
    state: PyTree,
    params: PyTree | None,
    into: PyTree | None = None,
    sums: Written | None = None,
) -> tuple[PyTree, PyTree] | None:
    """``update`` of ``program`` with the generated kernel where leaves allow it (new tensors, nothing written), or
    ``None`` as ``run_step``. ``into`` and ``sums``: ``run_step``'s (the new slots the kernel computes go there)."""
    if torch.compiler.is_compiling() or _backend.get() == "eager":  # inductor fuses a traced update itself
        return None
    first = next((leaf for leaf in optree.tree_leaves(updates) if isinstance(leaf, torch.Tensor)), None)
    if first is None or not is_plain(first) or generated_route(first.device) is None:  # eager, quickly
        return None
    ran = _run(program, updates, state, params, donate=False, applies=False, into=into, sums=sums)
    if ran is None:
        return None
    step, state, spec = ran
    return spec.unflatten(step.updates), state


def _run(
    program: Program,
    grads: PyTree,
    state: PyTree,
    params: PyTree | None,
    donate: bool,
    applies: bool,
    into: PyTree | None = None,
    checked: Checked | None = None,
    sums: Written | None = None,
) -> tuple[_Step, PyTree, Any] | None:
    # mismatched gradients are named here, as fadam.step's own check; a state of another layout is left to the
    # transforms' updates, which name what they expected
    what = "grads" if applies else "updates"
    grad_leaves, param_leaves, spec = checked or check_leaves(
        grads, grads if params is None else params, what=what, sparse=True
    )
    try:
        program, state = program.expanded(state)
        if params is None:
            if any(s.decl is not None and s.decl.uses_params for s in program.stages):
                return None  # the transform's own update names what is missing
            param_leaves = [None] * len(grad_leaves)
        reference_leaves = grad_leaves if params is None else param_leaves
        reference = grads if params is None else params
        stage_leaves = _stage_leaves(program, state, reference, reference_leaves, spec)
        into_leaves = None
        if into is not None:
            # the expanded program's paths name the same places in an unexpanded state, whose layout ``into`` has
            into_leaves = _stage_leaves(program, into, reference, reference_leaves, spec)
            if into_leaves is None:
                return None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError):
        return None
    check_sparse(program, grad_leaves, spec, params, what=what)  # before anything is written
    # gradients of another dtype than their params: chain casts them first, which the eager path does
    if params is not None and any(g is not None and g.dtype is not p.dtype for g, p in zip(grad_leaves, param_leaves)):
        return None
    parts = segments(program)
    if stage_leaves is None or not _any_fast_leaf(parts, param_leaves, grad_leaves, stage_leaves, applies):
        return None
    count = len(param_leaves)
    step = _Step(
        list(param_leaves), list(grad_leaves), list(param_leaves), [False] * count, stage_leaves, into_leaves, sums, {}
    )
    for number, part in enumerate(parts):
        if part.opaque:
            stage = part.stages[0]
            step.updates[:], new_state = _run_opaque(stage, spec, step.updates, state_at(state, stage.path), params)
            state = with_state_at(state, stage.path, new_state)
        else:
            last = number == len(parts) - 1
            torch_kernels = _torch_kernels_may_run(parts, applies) and into is None
            state = _run_segment(part, state, step, applies and last, donate, torch_kernels)
    return step, state, spec


def _torch_kernels_may_run(parts: list[Segment], applies: bool) -> bool:
    """Whether torch's fused kernels may take groups of this program: on the default backend, where the program is
    one declared segment that is applied to the params (torch's kernels step the params from the gradients)."""
    return applies and len(parts) == 1 and not parts[0].opaque and _backend.get() == "auto"


def _run_opaque(stage: Stage, spec: Any, updates: Leaves, state: Any, params: PyTree | None) -> tuple[Leaves, Any]:
    """An opaque stage's update of the leaves its masks select (``masked`` gives it those only); the others pass."""
    if not stage.selections:
        new_updates, new_state = stage.tx.update(spec.unflatten(updates), state, params)
        return spec.flatten_up_to(new_updates), new_state
    selected = leaf_selection(stage, spec.unflatten(updates) if params is None else params)
    inner_params = None if params is None else _select(params, selected)
    new_updates, new_state = stage.tx.update(_select(spec.unflatten(updates), selected), state, inner_params)
    new_leaves = iter(optree.tree_leaves(new_updates, none_is_leaf=True))
    return [next(new_leaves) if keep else u for u, keep in zip(updates, selected)], new_state


def fast_step(
    tx: Any,
    params: PyTree,
    grads: PyTree,
    state: PyTree,
    donate: bool,
    into: PyTree | None = None,
    checked: Checked | None = None,
    sums: Written | None = None,
) -> tuple[PyTree, PyTree] | None:
    """``tx``'s step by the fastest backend these tensors allow (``fadam.backend`` says which may run): a wrapper's own
    step (``FusibleUpdate``), else its program, where each group of leaves takes torch's fused kernel, the generated
    kernel or eager ops; ``None`` where no leaf takes a kernel (the caller runs ``update`` and ``apply_updates``).
    ``into`` (``run_step``'s): where the new state's slots go; a wrapper's own step, which updates its state in
    place, gets ``state`` copied there first. ``checked`` and ``sums``: ``run_step``'s (a wrapper's own step checks
    for itself and puts no sums)."""
    # while torch.compile traces, a wrapper's step decides for itself (paging runs outside the graph) and the program
    # is left to inductor, which fuses the traced update
    compiling = torch.compiler.is_compiling()
    if not compiling and _backend.get() == "eager":
        return None
    fused_step = getattr(tx.update, "fused_step", None)
    if fused_step is not None:
        result = fused_step(params, grads, state if into is None else _copied(state, into), donate)
        if result is not None:
            return result
    program = getattr(tx.update, "program", None)
    if program is None or compiling:
        return None
    return run_step(program, params, grads, state, donate, into, checked, sums)


def step_check(tx: Any, params: PyTree, grads: PyTree) -> Checked | None:
    """``check_leaves(grads, params)`` for a step that ``run_step`` will take (``tx`` a program without a wrapper's
    own step, on a backend with kernels), so that ``fadam.step`` checks and flattens the trees once for both its
    aliasing check and the step; else ``None``, leaving the checks to the path that runs."""
    if _backend.get() == "eager" or getattr(tx.update, "fused_step", None) is not None:
        return None
    if getattr(tx.update, "program", None) is None:
        return None
    return check_leaves(grads, params, what="grads", sparse=True)


def overlap_with_state(checked: Checked, state: PyTree) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """``overlap_in_leaves`` of ``checked``'s params and gradients and of ``state``'s leaves. Where the compiled check
    finds every storage distinct, the state is flattened only down to its quantized slots, which it reads whole:
    flattening into their four tensors each took most of the check's time for quantized state."""
    grad_leaves, param_leaves, _ = checked
    checks = compiled_checks()
    if checks is not None:
        grouped = optree.tree_leaves(state, is_leaf=_is_slot_leaf, none_is_leaf=True)
        if checks.distinct_storages([param_leaves, grad_leaves, grouped]):
            return None
    return overlap_in_leaves([param_leaves, grad_leaves, tree_leaves(state)])


def _copied(state: PyTree, into: PyTree) -> PyTree:
    """``into`` holding ``state``'s values (its tensor leaves copied in)."""
    for source, target in zip(optree.tree_leaves(state), optree.tree_leaves(into)):
        if isinstance(target, torch.Tensor):
            target.copy_(source)
    return into


def _segment_slots(part: Segment, leaves: dict[int, _StageLeaves], count: int) -> list[list[Any]]:
    """Every leaf's slot leaves in ``part`` (``_slots_of`` for each of ``count`` leaves)."""
    if any(stage.selections for stage in part.stages):
        return [_slots_of(part, leaves, i) for i in range(count)]
    columns = [slot for stage in part.stages for slot in leaves[id(stage)].slots]
    return [list(row) for row in zip(*columns)] if columns else [[] for _ in range(count)]


def _slots_of(part: Segment, leaves: dict[int, _StageLeaves], i: int) -> list[torch.Tensor]:
    """Leaf ``i``'s slot leaves in ``part``, over the stages that apply to it, in order."""
    found = []
    for stage in part.stages:
        entry = leaves[id(stage)]
        if entry.position[i] is not None:
            found.extend(slot[entry.position[i]] for slot in entry.slots)
    return found


def _any_fast_leaf(
    parts: list[Segment], params: Leaves, grads: Leaves, leaves: dict[int, _StageLeaves], applies: bool
) -> bool:
    """Whether a leaf may take a kernel: the generated one in the first declared segment, or torch's in the last."""
    if torch.compiler.is_compiling():  # ctypes calls cannot be traced; inductor fuses the traced update itself
        return False
    grad_enabled = torch.is_grad_enabled()
    first = next((part for part in parts if not part.opaque), None)
    if first is None:
        return False
    if any(
        ready(g if p is None else p, g, _slots_of(first, leaves, i), grad_enabled, first.storage)
        for i, (p, g) in enumerate(zip(params, grads))
    ):
        return True
    return (
        _torch_kernels_may_run(parts, applies)
        and shape_of(tuple(stage.decl for stage in first.stages)) is not None
        and any(
            torch_ready(p, g, _slots_of(first, leaves, i), grad_enabled) for i, (p, g) in enumerate(zip(params, grads))
        )
    )


def _run_segment(part: Segment, state: Any, step: _Step, applies: bool, donate: bool, torch_kernels: bool) -> Any:
    """Runs one declared segment on every leaf (updating ``step``'s lists); returns the state with the segment's
    stages advanced. ``torch_kernels``: torch's fused kernels may take its groups (``_torch_kernels_may_run``)."""
    grad_enabled = torch.is_grad_enabled()
    stage_states = [state_at(state, stage.path) for stage in part.stages]
    entries = [step.leaves[id(stage)] for stage in part.stages]
    scalars = [
        stage.decl.scalars(stage_state, [u for u, keep in zip(step.updates, entry.selected) if keep])
        for stage, stage_state, entry in zip(part.stages, stage_states, entries)
    ]
    eager_only = any(_graph_scalar(v, grad_enabled) for stage in scalars for v in stage.values())
    # before the kernels: a step over more memory than the caches hold leaves them cold for the small ops after it
    counts = [stage.decl.next_count(stage_state) for stage, stage_state in zip(part.stages, stage_states)]
    own, new_statistics = _statistics(part, scalars, step)
    storage = part.storage
    groups: dict[tuple[bool, ...], list[int]] = {}  # the stages that apply to a leaf -> its leaves
    if all(not stage.selections for stage in part.stages):
        groups[(True,) * len(entries)] = list(range(len(step.params)))
    else:
        for i in range(len(step.params)):
            groups.setdefault(tuple(entry.selected[i] for entry in entries), []).append(i)
    new_slots = [[list(slot) for slot in entry.slots] for entry in entries]
    torch_first = torch_kernels and not eager_only
    slot_rows = _segment_slots(part, step.leaves, len(step.params)) if not eager_only else []
    target_rows = _segment_slots(part, step.into, len(step.params)) if step.into and not eager_only else None
    for applying, members in groups.items():
        chosen = [k for k, flag in enumerate(applying) if flag]
        if torch_first and chosen:
            members = _run_torch_kernel(
                part, chosen, stage_states, scalars, members, slot_rows, step, new_slots, donate
            )
        kernel: dict[int, list[Any]] = {}  # the leaves that take the kernel -> their slot leaves
        codes: dict[int, int] = {}  # the leaves the compiled checks accepted -> their layout codes
        if not eager_only and chosen:
            # the slots the kernel writes into (``into``'s) are checked with those it reads
            checked = [slot_rows[i] if target_rows is None else [*slot_rows[i], *target_rows[i]] for i in members]
            for i, slots, code in zip(members, checked, _ready_on_cpu(step, members, checked, grad_enabled, storage)):
                if code:
                    kernel[i], codes[i] = slot_rows[i], code
                elif ready(_reference(step, i), step.updates[i], slots, grad_enabled, storage):
                    kernel[i] = slot_rows[i]
        if kernel:
            _run_kernel(part, chosen, scalars, kernel, step, new_slots, applies, donate, target_rows, own, codes)
        taken = kernel
        eager = [i for i in members if i not in taken]
        if eager and chosen:
            _run_eager(part, chosen, scalars, eager, step, new_slots, own)
    for stage, stage_state, entry, slots, found, statistics, counted in zip(
        part.stages, stage_states, entries, new_slots, scalars, new_statistics, counts
    ):
        trees, statistic_trees = ([entry.spec.unflatten(leaves) for leaves in kind] for kind in (slots, statistics))
        advanced = stage.decl.advance(stage_state, trees, found, statistic_trees, counted)
        state = with_state_at(state, stage.path, advanced)
    return state


def _ready_on_cpu(
    step: _Step, members: list[int], slots: list[list[Any]], grad_enabled: bool, storage: Storage | None
) -> list[int]:
    """Per leaf of ``members``, the layout code of a leaf that the compiled checks accept for the C++ kernel as
    ``ready`` would (``rows_ready``: leaves of one code share their dtypes), in one call for all of them; 0: ask
    ``ready``."""
    checks = compiled_checks()
    if checks is None or _backend.get() == "triton":
        return [0] * len(members)
    params = [step.params[i] for i in members]
    updates = [step.updates[i] for i in members]
    bits, block = (0, 0) if storage is None else (storage.bits, storage.block)
    return checks.rows_ready(params, updates, slots, grad_enabled, bits, block)


def _statistics(part: Segment, scalars: list[dict], step: _Step) -> tuple[list[list | None], list[list]]:
    """Each stage's statistics advanced (``leaf_statistics``) on the leaves it applies to: per stage, each of its
    leaves' values for the body (``None`` for a stage without statistics) and each statistic's new leaves."""
    own: list[list | None] = []
    new: list[list] = []
    for stage, found in zip(part.stages, scalars):
        entry = step.leaves[id(stage)]
        if stage.decl.reduce_statistics is None:
            own.append(None)
            new.append([])
            continue
        chosen = [i for i, keep in enumerate(entry.selected) if keep]
        updates = [step.updates[i] for i in chosen]
        params = [step.params[i] for i in chosen]
        given = [[decode_slot(leaf, stage.storage) for leaf in leaves] for leaves in entry.statistics]
        values, leaves = leaf_statistics(stage.decl, found, updates, params, given)
        own.append(values)
        # stored as before: a quantized one (``quantize_state``) requantized with the map its values call for, as
        # that wrapper's eager path does; one left as it was keeps its codes
        stored = []
        for old_leaves, decoded, new_leaves in zip(entry.statistics, given, leaves):
            stored.append(
                [
                    old if value is before else encode_slot(value, old, None, stage.storage)
                    for old, before, value in zip(old_leaves, decoded, new_leaves)
                ]
            )
        new.append(stored)
    return own, new


def _run_torch_kernel(
    part: Segment,
    chosen: list[int],
    stage_states: list[Any],
    scalars: list[dict],
    members: list[int],
    slot_rows: list[list[Any]],
    step: _Step,
    new_slots: list,
    donate: bool,
) -> list[int]:
    """Runs torch's fused kernel for the stages ``chosen`` of ``part``, if they are its chain, on the leaves of
    ``members`` that allow it (``torch_ready``), one call per device and dtype; returns the other members."""
    decls = tuple(part.stages[k].decl for k in chosen)
    if shape_of(decls) is None:
        return members
    by_place = _torch_places(members, step, slot_rows)
    taken: set[int] = set()
    for (device, dtype), group in by_place.items():
        found = torch_kernel(decls, [stage_states[k] for k in chosen], [scalars[k] for k in chosen], device.type)
        if found is None or (dtype.is_complex and not found.takes_complex):
            continue
        params = [step.params[i] if donate else step.params[i].clone() for i in group]
        slots = [slot_rows[i] if donate else [t.clone() for t in slot_rows[i]] for i in group]
        lists = [params, [step.updates[i] for i in group], *map(list, zip(*slots))]
        if dtype.is_complex:
            lists = [[real_view(t) for t in tensors] for tensors in lists]
        with torch.no_grad():
            found.run(device, *lists)
        _store(part, chosen, step, new_slots, group, slots)
        for i, p in zip(group, params):
            step.new_params[i], step.applied[i], step.updates[i] = p, True, None
        taken.update(group)
    return [i for i in members if i not in taken]


def _torch_places(members: list[int], step: _Step, slot_rows: list[list[Any]]) -> dict[tuple, list[int]]:
    """The leaves of ``members`` that torch's fused kernels can take, by their device and dtype (``torch_place``).
    Leaves all of the first one's place, the common case, are checked in one pass."""
    grad_enabled = torch.is_grad_enabled()
    if not members:
        return {}
    first = members[0]
    place = torch_place(step.params[first], step.updates[first], slot_rows[first], grad_enabled)
    if place is not None:
        tensors = [t for i in members for t in (*slot_rows[i], step.params[i], step.updates[i])]
        if _placed(tensors, *place, grad_enabled):
            return {place: list(members)}
    by_place: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i in members:
        place = torch_place(step.params[i], step.updates[i], slot_rows[i], grad_enabled)
        if place is not None:
            by_place.setdefault(place, []).append(i)
    return by_place


def _store(part: Segment, chosen: list[int], step: _Step, new_slots: list, group: list[int], outputs: list) -> None:
    """Puts each leaf of ``group``'s new slot leaves (``outputs``, in ``_slots_of``'s order) into ``new_slots``."""
    targets = [(new_slots[k], step.leaves[id(part.stages[k])].position) for k in chosen if new_slots[k]]
    for i, leaves in zip(group, outputs):
        found = iter(leaves)
        for slots, position in targets:
            where = position[i]
            for slot in slots:
                slot[where] = next(found)


def _reference(step: _Step, i: int) -> torch.Tensor | None:
    """The tensor whose dtype and device leaf ``i``'s kernel follows: its param, or its update without params."""
    return step.updates[i] if step.params[i] is None else step.params[i]


def _run_eager(
    part: Segment,
    chosen: list[int],
    scalars: list[dict],
    members: list[int],
    step: _Step,
    new_slots: list,
    own: list[list | None],
) -> None:
    updates = [step.updates[i] for i in members]
    for k in chosen:
        stage = part.stages[k]
        decl, entry = stage.decl, step.leaves[id(stage)]
        where = [entry.position[i] for i in members]
        params = [step.params[i] for i in members] if decl.uses_params else [None] * len(members)
        given = [[s[w] for w in where] for s in new_slots[k]]
        full = [[decode_slot(leaf, stage.storage) for leaf in leaves] for leaves in given]
        values = None if own[k] is None else [own[k][w] for w in where]
        updates, results = eager_stage(decl, scalars[k], updates, params, full, values)
        for slot, spec, old, decoded, result in zip(new_slots[k], decl.slots, given, full, results):
            for w, leaf, before, value in zip(where, old, decoded, result):
                # a leaf the stage left as it was (no gradient) keeps its codes exactly
                slot[w] = leaf if value is before else encode_slot(value, leaf, spec, stage.storage)
    for i, u in zip(members, updates):
        step.updates[i] = u


def decode_slot(leaf: Any, storage: Storage | None) -> Any:
    """A slot leaf in full precision: a quantized one decoded to float32, any other as it is."""
    if type(leaf) is not QuantizedArray:
        return leaf
    return dequantize_blockwise(leaf, bits=storage.bits, block_size=storage.block)


def encode_slot(value: Any, stored: Any, slot: Slot | None, storage: Storage | None) -> Any:
    """A slot's new value stored as its old leaf was: requantized with the slot's map (``slot_map``; without a slot,
    the map its values call for) where that was quantized."""
    if type(stored) is not QuantizedArray:
        return value
    if slot is None:
        return quantize_blockwise(value, storage.bits, storage.block)
    map_id = torch.full((), slot_map(slot.nonnegative, storage.bits), dtype=torch.uint8, device=stored.map_id.device)
    return quantize_blockwise(value, storage.bits, storage.block, map_id=map_id)


def _run_kernel(
    part: Segment,
    chosen: list[int],
    scalars: list[dict],
    members: dict[int, list[Any]],
    step: _Step,
    new_slots: list,
    applies: bool,
    donate: bool,
    targets: list[list[Any]] | None,
    own: list[list | None],
    codes: dict[int, int],
) -> None:
    """Runs the stages ``chosen`` of ``part`` in the generated kernel on ``members`` (leaf -> its slot leaves, which
    the kernel reads and writes where donated; elsewhere, or in ``targets``, each leaf's slot leaves to write).
    ``own``: per stage, its leaves' values from their statistics (``_statistics``). ``codes``: the layout codes of
    the members that ``_ready_on_cpu`` accepted."""
    decls: list[Elementwise] = [part.stages[k].decl for k in chosen]
    traced = trace(tuple(decls), applies)
    per_stage = [scalars[k] for k in chosen]
    host_values: list[float] | None = None  # the scalars as doubles, read once for the groups that take them
    leaf_reducing = [(j, decls[j]) for j in range(len(decls)) if decls[j].reduce_leaf is not None]
    slot_specs = [slot for decl in decls for slot in decl.slots]
    by_layout: dict[tuple, list[int]] = {}  # the leaves by their layout (``_layout``)
    with_values = any(own[k] is not None for k in chosen)
    own_values = {i: _leaf_values(part, chosen, own, step, i) for i in members} if with_values else {}
    eager: list[int] = []
    # without spreads, the leaves of one layout code share a layout: the first one's (most steps: every leaf's)
    coded = not traced.graph.operands and len(codes) == len(members)
    by_code: dict[int, list[int]] = {}
    for i, slot_leaves in members.items():
        if coded and codes[i] in by_code:
            by_code[codes[i]].append(i)
            continue
        spreads = _spreads(traced, own_values[i], _reference(step, i)) if traced.graph.operands else ()
        if spreads is None:
            eager.append(i)
            continue
        group = by_layout.setdefault(_layout(step, i, slot_leaves, spreads), [])
        group.append(i)
        if coded:
            by_code[codes[i]] = group
    if eager:
        _run_eager(part, chosen, scalars, eager, step, new_slots, own)
    rounded_tensors = _tensor_weights(traced, [scalars[k] for k in chosen])
    storage = part.storage
    operands = len(traced.graph.operands)
    for key, group in by_layout.items():
        device, dtype = key[0], key[1]
        slot_dtypes, operand_dtypes = key[2 : len(key) - operands], key[len(key) - operands :]
        stored = tuple(d is _QUANTIZED for d in slot_dtypes)
        slot_dtypes = tuple(torch.float32 if q else d for d, q in zip(slot_dtypes, stored))
        dtypes = (dtype, *([dtype] if traced.reads_params else []), *slot_dtypes, *operand_dtypes)
        formats = tuple(
            Quantized(storage.bits, storage.block, slot_map(slot.nonnegative, storage.bits)) if quantized else None
            for slot, quantized in zip(slot_specs, stored)
        )
        low_precision = rounded_tensors and torch.bfloat16 in dtypes
        # slots written into another place (a file's other copy) stream out, summed for its checksum on the way
        streamed = (
            step.sums is not None
            and targets is not None
            and bool(slot_specs)
            and all(f is None or f.sums_codes for f in formats)
        )
        kernel = None if low_precision else _generated(device, traced, dtypes, formats if any(stored) else (), streamed)
        if kernel is None:
            _run_eager(part, chosen, scalars, group, step, new_slots, own)
            continue
        rows, outputs, finals, leaf_values = [], [], [], []
        quantized_group, reads_params = any(stored), traced.reads_params
        for i in group:
            p, u = step.params[i], step.updates[i]
            if leaf_reducing:  # a leaf reduction runs first in its segment, on the segment's input
                found = {f"{j}.{k}": v for j, decl in leaf_reducing for k, v in decl.reduce_leaf(u, p).items()}
                leaf_values.extend(found[name] for name in traced.graph.leaf_scalars)
            elif own_values:
                leaf_values.extend(_indexed(own_values[i], traced.graph.leaf_scalars, u.shape))
            slot_in = members[i]
            if targets is not None:
                slot_out = targets[i]
            else:
                slot_out = slot_in if donate else [_empty_like(t) for t in slot_in]
            if applies:
                final = p if donate else torch.empty_like(p)
            else:
                final = u if step.owned.get(i) is u else torch.empty_like(u)
            read = _pointed(slot_in) if quantized_group else slot_in
            written = read if slot_out is slot_in else (_pointed(slot_out) if quantized_group else slot_out)
            row = [u, p, *read, *written, final] if reads_params else [u, *read, *written, final]
            if u.is_complex():
                row = [real_view(t) for t in row]
            if operands:
                row.extend(own_values[i][name].values for name in traced.graph.operands)
            rows.append(row)
            outputs.append(slot_out)
            finals.append(final)
        if _scalars_on_device(kernel, per_stage, leaf_values):
            values, leaf_values = scalar_values(per_stage, traced.graph, device), device_vector(leaf_values, device)
        else:
            host_values = scalar_values(per_stage, traced.graph) if host_values is None else host_values
            values, leaf_values = host_values, [float(v) for v in leaf_values]
        if getattr(kernel, "streamed", False):
            sums = torch.empty((len(group), len(slot_specs), 16), dtype=torch.int64)
            kernel.run(rows, values, leaf_values, sums)
            _keep_sums(step.sums, outputs, ctypes.string_at(sums.data_ptr(), sums.numel() * 8))
        else:
            kernel.run(rows, values, leaf_values)
        _store(part, chosen, step, new_slots, group, outputs)
        for i, final in zip(group, finals):
            if applies:
                step.new_params[i], step.applied[i], step.updates[i] = final, True, None
            else:
                step.updates[i] = step.owned[i] = final


def _keep_sums(found: Written, outputs: list[list[Any]], raw: bytes) -> None:
    """Puts in ``found`` the sums a streamed kernel took of each slot leaf it wrote (``raw``: 128 bytes a slot leaf,
    leaf by leaf as ``outputs``), by the data pointer of the leaf (of a quantized slot: of its codes). An empty leaf's
    data pointer is null (torch's), which no checksum looks up."""
    written = [leaf.codes if type(leaf) is QuantizedArray else leaf for slots in outputs for leaf in slots]
    checks = compiled_checks()
    pointers = array.array("Q", checks.data_pointers([written])) if checks else [t.data_ptr() for t in written]
    found.update(zip(pointers, [raw[128 * j : 128 * (j + 1)] for j in range(len(written))]))


def _layout(step: _Step, i: int, slot_leaves: list[Any], spreads: Any) -> tuple:
    """Leaf ``i``'s layout in ``_run_kernel``: its device, the dtypes the kernel reads (a complex leaf's: its reals'),
    a quantized slot marked as such."""
    real = _REAL.get
    reference = _reference(step, i)
    dtype = reference.dtype
    slot_dtypes = [_QUANTIZED if type(t) is QuantizedArray else real(t.dtype, t.dtype) for t in slot_leaves]
    return (reference.device, real(dtype, dtype), *slot_dtypes, *(t.dtype for t in spreads))


def _leaf_values(part: Segment, chosen: list[int], own: list[list | None], step: _Step, i: int) -> dict[str, Any]:
    """Leaf ``i``'s values from its statistics in the stages ``chosen``, named as the traced graph names them."""
    found: dict[str, Any] = {}
    for j, k in enumerate(chosen):
        if own[k] is not None:
            values = own[k][step.leaves[id(part.stages[k])].position[i]]
            found |= {f"{j}.{name}": v for name, v in values.items()}
    return found


def _spreads(traced: Any, values: dict[str, Any], reference: torch.Tensor) -> list[torch.Tensor] | None:
    """The tensors of a leaf's spreads in the graph's order, or ``None`` where the kernel cannot read one (a complex
    leaf, whose elements are pairs of reals; a spread that is not a contiguous tensor of a kernel dtype beside it)."""
    if reference.is_complex():
        return None
    found = []
    for name in traced.graph.operands:
        spread = values[name]
        t = spread.values
        placed = type(t) in PLAIN_TYPES and t.device == reference.device and t.is_contiguous()
        if not placed or t.dtype not in KERNEL_DTYPES or t.requires_grad:
            return None
        found.append(t)
    return found


def _indexed(values: dict[str, Any], names: list[str], shape: torch.Size) -> list[float]:
    """A leaf's scalars in the graph's order: its numbers, and each spread's ``Spread.indexing`` for its shape."""
    found = []
    for name in names:
        key, _, part = name.partition(":")
        if part:
            inner, count = values[key].indexing(shape)
            found.append(inner if part == "inner" else count)
        else:
            found.append(values[key])
    return found


def _scalars_on_device(kernel: Any, per_stage: list[dict], leaf_values: list[Any]) -> bool:
    """Whether a kernel's scalars go to it as one tensor on its device: for the Triton kernel in a capturable step
    (``fadam._numerics.resident``) or where a scalar is a tensor off the CPU (a global norm, a count on the device),
    which reading as a double would sync. The C++ kernel reads doubles from host memory."""
    if not isinstance(kernel, _triton_kernel.TritonKernel):
        return False
    if is_resident():
        return True
    found = [v for stage in per_stage for v in stage.values()] + leaf_values
    return any(isinstance(v, torch.Tensor) and v.device.type != "cpu" for v in found)


def _generated(
    device: torch.device, traced: Any, dtypes: tuple[torch.dtype, ...], formats: tuple, streamed: bool = False
) -> Kernel | _triton_kernel.TritonKernel | None:
    """The generated kernel of ``traced`` for leaves on ``device``: C++ on the CPU (``streamed``: ``source``'s), else
    Triton (``generated_route``), whose multiply-adds round as ATen's kernels on that device round them (once on
    CUDA, where nvcc contracts them; on the CPU as its vectorized build does)."""
    if generated_route(device) == "cpu":
        return load(traced, dtypes, formats, streamed)
    return _triton_kernel.load(traced, dtypes, formats, fma=_aten_fma() if device.type == "cpu" else True)


_QUANTIZED = object()  # stands for a quantized slot's dtype in ``_run_kernel``'s layouts
_REAL = {torch.complex64: torch.float32, torch.complex128: torch.float64}  # complex leaves run as pairs of reals


def _tensor_weights(traced: Any, scalars: list[dict]) -> bool:
    """Whether a tensor scalar is lerp's weight, addcmul's value or add's alpha in ``traced``: EagerOps rounds such a
    tensor to a bfloat16 leaf's dtype where ATen keeps a number in float, so bfloat16 leaves then run eagerly."""
    tensors = {
        f"{j}.{name}" for j, found in enumerate(scalars) for name, v in found.items() if isinstance(v, torch.Tensor)
    }
    return bool(tensors & weight_scalars(traced))


def _empty_like(leaf: Any) -> Any:
    if type(leaf) is QuantizedArray:
        codes, absmax, map_id = (torch.empty_like(t) for t in leaf[:3])
        return leaf._replace(codes=codes, absmax=absmax, map_id=map_id)
    return torch.empty_like(leaf)


def _pointed(leaves: list[Any]) -> list[torch.Tensor]:
    """The tensors a kernel reads or writes for ``leaves``: a quantized one's codes, absmax and map id."""
    found = []
    for leaf in leaves:
        if type(leaf) is QuantizedArray:
            found.extend(leaf[:3])
        else:
            found.append(leaf)
    return found


def explain(tx: Any, params: PyTree, grads: PyTree | None = None, state: PyTree | None = None) -> str:
    """Which backend each group of ``params``' leaves takes in ``fadam.step(tx, params, grads, state)``, and why.

    ``grads`` default to zeros like the params and ``state`` to ``tx.init(params)``; nothing is stepped. A line per
    segment of the program and backend: the stages, the backend (or why not the generated kernel), the leaves. An
    opaque transform's line says eager for every leaf: fadam transforms that it calls choose their own backends (as
    ``quantize_state`` of a chain with an opaque member runs that chain on the decoded state).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.chain(fadam.scale_by_lion(), fadam.scale(-1e-4))
        >>> print(fadam.explain(tx, {"w": torch.zeros(4), "h": torch.zeros(2, dtype=torch.float16)}))
        scale_by_lion -> scale: eager: torch.float16 (the kernel takes float32, float64 and bfloat16): ['h']
        scale_by_lion -> scale: generated CPU kernel: ['w']
    """
    grads = grads if grads is not None else optree.tree_map(torch.zeros_like, params)
    state = state if state is not None else tx.init(params)
    lines = []
    if getattr(tx.update, "fused_step", None) is not None and _backend.get() != "eager":
        name = _opaque_name(Stage(None, (), tx))
        inner = getattr(tx.update, "inner", None)
        if inner is None:
            return f"{name}: its own step, which runs its inner transform by the fastest backend its tensors allow"
        inner_tx, field = inner
        found = explain(inner_tx, params, grads, getattr(state, field))
        return "\n".join(
            [f"{name}: its own step, then its inner transform's:", *("  " + line for line in found.split("\n"))]
        )
    program, state = program_of(tx).expanded(state)
    paths = tree_paths(params)
    grad_leaves, param_leaves, spec = check_leaves(grads, params, what="grads", sparse=True)
    check_sparse(program, grad_leaves, spec, params, what="grads")  # the step would refuse them
    leaves = _stage_leaves(program, state, params, param_leaves, spec)
    if leaves is None:
        return "\n".join([*lines, "eager: the state is not laid out as the transform's init lays it out"])
    grad_enabled = torch.is_grad_enabled()
    parts = segments(program)
    torch_kernels = _torch_kernels_may_run(parts, applies=True)
    no_cpu_kernel = unbuildable()
    for number, part in enumerate(parts):
        if part.opaque:
            lines.append(f"{_opaque_name(part.stages[0])}: eager (an opaque transform): all {len(paths)} leaves")
            continue
        scalars = [  # as the step computes them, here from the given grads
            stage.decl.scalars(
                state_at(state, stage.path), [g for g, keep in zip(grad_leaves, leaves[id(stage)].selected) if keep]
            )
            for stage in part.stages
        ]
        recorded = any(_graph_scalar(v, grad_enabled) for found in scalars for v in found.values())
        groups: dict[tuple[str, str], list[str]] = {}
        for i, (p, g) in enumerate(zip(param_leaves, grad_leaves)):
            chosen = [k for k, s in enumerate(part.stages) if leaves[id(s)].selected[i]]
            names = " -> ".join(part.stages[k].decl.name for k in chosen)
            if not names:
                continue  # its mask leaves the leaf out of every stage here
            slots = _slots_of(part, leaves, i)
            if torch_kernels and not recorded:
                kernel = _torch_kernel_for(part, chosen, state, scalars, p, g, slots, grad_enabled)
                if kernel is not None:
                    groups.setdefault((names, kernel), []).append(paths[i])
                    continue
            reason = refusal(p, g, slots, grad_enabled, part.storage)
            if reason is None and recorded:
                reason = "a hyperparameter that autograd or torch.func records"
            low = [t.dtype for t in (p, *slots) if isinstance(t, torch.Tensor)]
            traced = trace(tuple(part.stages[k].decl for k in chosen), number == len(parts) - 1)
            if reason is None and torch.bfloat16 in low and _tensor_weights(traced, [scalars[k] for k in chosen]):
                reason = "a bfloat16 leaf with a tensor as lerp's weight, addcmul's value or add's alpha"
            if reason is None and traced.graph.operands and p.is_complex():
                reason = "a complex leaf with spreads (factored statistics), which the kernel does not read"
            route = generated_route(p.device)
            if reason is None and route == "cpu" and no_cpu_kernel is not None:
                reason = no_cpu_kernel
            backend = _GENERATED_NAMES[route] if reason is None else f"eager: {reason}"
            groups.setdefault((names, backend), []).append(paths[i])
        for (names, backend), members in sorted(groups.items()):
            shown = ", ".join(members[:4]) + (f", ... ({len(members)} leaves)" if len(members) > 4 else "")
            lines.append(f"{names}: {backend}: {shown}")
        state = _counted_on(part, state, scalars)
    return "\n".join(lines)


def _counted_on(part: Segment, state: Any, scalars: list[dict]) -> Any:
    """``state`` with the counts (and carried values) of ``part``'s stages advanced as a step advances them, its
    slots and statistics as they are: what the later segments' prologues read (``Elementwise.shares_count``)."""
    for stage, found in zip(part.stages, scalars):
        held = state_at(state, stage.path)
        trees = [[getattr(held, field.name) for field in kind] for kind in (stage.decl.slots, stage.decl.statistics)]
        state = with_state_at(state, stage.path, stage.decl.advance(held, trees[0], found, trees[1]))
    return state


_GENERATED_NAMES = {"cpu": "generated CPU kernel", "triton": "generated Triton kernel"}


def _torch_kernel_for(
    part: Segment,
    chosen: list[int],
    state: Any,
    scalars: list[dict],
    p: torch.Tensor,
    g: torch.Tensor | None,
    slots: list[Any],
    grad_enabled: bool,
) -> str | None:
    """The name of torch's fused kernel that a leaf takes in the last segment, as ``_run_torch_kernel`` decides."""
    decls = tuple(part.stages[k].decl for k in chosen)
    if shape_of(decls) is None or not torch_ready(p, g, slots, grad_enabled):
        return None
    states = [state_at(state, part.stages[k].path) for k in chosen]
    found = torch_kernel(decls, states, [scalars[k] for k in chosen], p.device.type)
    return None if found is None or (p.is_complex() and not found.takes_complex) else found.name


def _opaque_name(stage: Stage) -> str:
    """A readable name for an opaque stage: where its state sits, and its update function's name."""
    update = stage.tx.update if stage.tx is not None else None
    update = getattr(update, "_update", update)  # the function a FusibleUpdate or ProgramUpdate calls
    name = getattr(update, "__qualname__", "update").split(".<locals>")[0].removesuffix(".update")
    return f"{name} (state at {list(stage.path)})" if stage.path else name
