"""Elementwise transforms declared once, and the programs that chains compose from them.

A transform whose math is per element declares it as an ``Elementwise``:

- its state: a ``NamedTuple`` type holding an optional step count and one tree per ``Slot`` (a moment, a trace);
- a *prologue*, ``prologue(count) -> {name: scalar}``, run once per step on the steps taken so far: bias
  corrections, scheduled rates, every number the body needs that does not depend on the element; a transform with
  0-d state besides the count (``Carried``: NAdam's running product) gets its values too, and returns the next ones;
- optionally a *reduction*, ``reduce(updates) -> {name: scalar}``, over all of its incoming updates at once (a
  global norm), or a *leaf reduction*, ``reduce_leaf(u, p) -> {name: scalar}``, over one leaf's update and param (a
  trust ratio), whose scalars feed the body like the prologue's;
- or per-leaf *statistics* (``Statistic``: state leaves of any shape, Adafactor's row and column means) that
  ``reduce_statistics(scalars, u, p, *statistics) -> ({name: scalar or Spread}, new statistics)`` advances with torch
  ops, leaf by leaf, on every backend; a ``Spread`` it gives is a value per element broadcast from fewer (a row
  factor), which the body reads as an element of the leaf;
- a *body*, ``body(o, s, u, p, *slots) -> (u, *slots)``, the math of one element: ``u`` the incoming update, ``p``
  the param (``None`` unless ``uses_params``), ``s`` the scalars by name, ``o`` the operations beyond Python's
  operators (``o.sqrt``, ``o.sign``, ``o.maximum``, ``o.where``, ``o.cast`` ...);
- optionally a *sparse rule* (``SparseRule``): how the body takes a sparse COO update, at its stored elements or
  densified (``fadam._sparse``); without one, sparse updates are refused.

The same body runs on torch tensors, which is the transform's ``update`` (autograd, ``torch.func``, DTensor, the
meta device: whatever torch ops support), and on symbols, which ``trace`` records as a ``Graph`` that a backend
compiles (``fadam._cpu_kernel``). Every operation rounds once, in the leaf's dtype, in both: no fused multiply-add,
no reassociation. Arithmetic between two scalars is refused when traced: it belongs in the prologue, where it is
computed once in double precision as the eager body would compute it.

``chain`` composes its members' declarations into a ``Program``: a sequence of stages, each a declaration with the
place of its state in the chain's state, or an opaque transform (plain ``init``/``update``), which the backends run
as it is. A transform may be a program of several stages itself, on one state: torch's Adafactor scales by a norm of
its first stage's whole update in a second stage, which reads the count that the first advanced (``shares_count``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch

from fadam._base import GradientTransformation
from fadam._dispatch import is_plain, is_sparse, real_view
from fadam._numerics import device_vector, dtype_for, for_leaf, safe_increment, safe_sqrt, zero_count
from fadam._tree import PyTree, check_leaves, check_params, tree_map
from fadam.transforms._validation import check_state

Scalars = dict[str, "float | torch.Tensor"]


class Slot(NamedTuple):
    """One tree of per-element state: its field name in the state and its dtype (``None``: the param's)."""

    name: str
    dtype: torch.dtype | None = None
    requires_grad: bool = False  # created as leaves that autograd tracks (meta-gradients into the initial state)
    # the body keeps it >= 0 once it is (from init on): quantized storage gives it the non-negative map
    nonnegative: bool = False


class Carried(NamedTuple):
    """A 0-d state tensor besides the count that the prologue advances once a step (NAdam's running product): the
    prologue takes its value after the count and returns the next one among its scalars, under its name."""

    name: str
    init: Callable[[], torch.Tensor]


class Statistic(NamedTuple):
    """A tree of per-leaf state of any shape that ``reduce_statistics`` advances (not the body): its field name and
    its leaf for a param, ``init(p)``."""

    name: str
    init: Callable[[torch.Tensor], torch.Tensor]


class Spread(NamedTuple):
    """A value per element of a leaf held by fewer numbers: ``values`` has the leaf's shape without its ``span``
    consecutive dims from ``dim`` on (the same all along them), or, where ``dim`` is ``None``, the leaf's shape or
    one element (the same everywhere)."""

    values: torch.Tensor
    dim: int | None = None
    span: int = 1

    def over(self, leaf: torch.Tensor, pairs: bool = False) -> torch.Tensor:
        """``values`` as a tensor that broadcasts to ``leaf`` (``pairs``: to a complex leaf's real view)."""
        values = self.values
        if self.dim is not None:
            for _ in range(self.span):
                values = values.unsqueeze(self.dim)
        elif values.shape != leaf.shape:
            values = values.reshape(())
        return values.unsqueeze(-1) if pairs and values.dim() else values

    def indexing(self, shape: torch.Size) -> tuple[int, int]:
        """``(inner, count)`` such that element ``f`` of a leaf of ``shape`` (flat, contiguous) reads the flat
        ``values`` at ``(f // (inner * count)) * inner + f % inner``: ``inner`` the elements after the dims spread
        over, ``count`` theirs."""
        if self.dim is not None:
            end = self.dim + self.span
            return math.prod(shape[end:]), math.prod(shape[self.dim : end])
        numel = math.prod(shape)
        return (max(numel, 1), 1) if self.values.numel() == numel else (1, max(numel, 1))


class SparseRule(NamedTuple):
    """How a declared transform takes a sparse COO update (the gradient of ``nn.Embedding(sparse=True)``), which
    ``fadam._sparse`` runs: ``lazy``, its body runs on the elements the update stores (coalesced first: repeated
    indices summed), its slots change there only and its update is sparse too; else its body runs on the densified
    update (a momentum trace, which torch.optim keeps sparse with the same values), giving a dense update."""

    lazy: bool = True
    dense: str | None = None  # None where dense updates are taken too, else why they are refused


class Elementwise(NamedTuple):
    """The per-element math of one transform (see the module's docstring)."""

    name: str
    state_type: type
    slots: tuple[Slot, ...]
    counted: bool  # the state's first field is a step count
    prologue: Callable[..., Scalars]  # (count, *carried) -> scalars
    body: Callable[..., tuple]
    uses_params: bool = False
    reduce: Callable[[list[torch.Tensor | None]], Scalars] | None = None
    reduce_leaf: Callable[[torch.Tensor, torch.Tensor | None], Scalars] | None = None
    carried: tuple[Carried, ...] = ()  # state fields after the count, before the slots
    # the hyperparameters by name, as given to the factory: what recognizes a run of declarations that one of torch's
    # fused kernels computes (fadam._torch_kernels)
    options: tuple[tuple[str, Any], ...] = ()
    # how it takes sparse COO updates: a SparseRule, or why it refuses them (None: it does not say)
    sparse: SparseRule | str | None = None
    statistics: tuple[Statistic, ...] = ()  # state fields after the slots
    # (step scalars, u, p, *statistics leaves) -> (leaf values by name: numbers or Spreads, new statistics leaves)
    reduce_statistics: Callable[..., tuple[dict[str, Any], tuple[torch.Tensor, ...]]] | None = None
    # a stage without state of its own that reads the count of the stage before it at its path (one transform's
    # stages sharing its state): its prologue runs after that stage advanced it, on the steps taken, this one included
    shares_count: bool = False

    def option(self, name: str) -> Any:
        return dict(self.options)[name]

    @property
    def reduces(self) -> bool:
        """Whether the body needs its input updates whole before it runs (a reduction over them)."""
        return self.reduce is not None or self.reduce_leaf is not None or self.reduce_statistics is not None

    @property
    def stateless(self) -> bool:
        return not self.counted and not self.slots and not self.carried and not self.statistics

    def init(self, params: PyTree) -> Any:
        if self.stateless:
            return self.state_type()
        if self.slots or self.statistics:
            check_params(params)
        trees = [
            tree_map(
                lambda p, slot=slot: (
                    None
                    if p is None
                    else torch.zeros_like(p, dtype=dtype_for(p, slot.dtype), requires_grad=slot.requires_grad)
                ),
                params,
            )
            for slot in self.slots
        ]
        trees += [tree_map(lambda p, st=st: None if p is None else st.init(p), params) for st in self.statistics]
        carried = [c.init() for c in self.carried]
        return self.state_type(*([zero_count()] if self.counted else []), *carried, *trees)

    def scalars(self, state: Any, updates: list[torch.Tensor | None]) -> Scalars:
        """The per-step scalars for ``state``: the prologue's, then the reduction's over ``updates``."""
        count = state.count if self.counted or self.shares_count else None
        scalars = self.prologue(count, *(getattr(state, c.name) for c in self.carried))
        if self.reduce is not None:
            scalars = {**scalars, **self.reduce(updates)}
        return scalars

    def next_count(self, state: Any) -> list[torch.Tensor]:
        """The state's count after this step, in a list; an empty one where the transform counts no steps."""
        return [safe_increment(state.count)] if self.counted else []

    def advance(
        self,
        state: Any,
        slot_trees: Sequence[PyTree],
        scalars: Scalars,
        statistic_trees: Sequence[PyTree] = (),
        counted: list[torch.Tensor] | None = None,
    ) -> Any:
        """The state after the step whose ``scalars`` were computed, holding ``slot_trees`` and
        ``statistic_trees``; ``counted``: ``next_count``'s, where it was taken before."""
        if self.stateless:
            return state
        carried = [scalars[c.name] for c in self.carried]
        counted = self.next_count(state) if counted is None else counted
        return self.state_type(*counted, *carried, *slot_trees, *statistic_trees)


def leaf_statistics(
    decl: Elementwise,
    scalars: Scalars,
    updates: list[torch.Tensor | None],
    params: list[torch.Tensor | None],
    statistics: list[list[torch.Tensor]],
) -> tuple[list[dict[str, Any] | None], list[list[torch.Tensor]]]:
    """``decl.reduce_statistics`` leaf by leaf: each leaf's values for the body (``None`` without an update, whose
    statistics stay as they are) and each statistic's new leaves."""
    values: list[dict[str, Any] | None] = []
    new = [list(leaves) for leaves in statistics]
    for index, u in enumerate(updates):
        if u is None:
            values.append(None)
            continue
        own, leaves = decl.reduce_statistics(scalars, u, params[index], *[s[index] for s in statistics])
        values.append(own)
        for out, leaf in zip(new, leaves):
            out[index] = leaf
    return values, new


def elementwise(decl: Elementwise) -> GradientTransformation:
    """The transform that ``decl`` declares: ``init`` builds its state, ``update`` runs its body on torch tensors,
    leaf by leaf. The update carries the declaration as ``update.program`` for ``chain`` and ``fadam.step``."""

    program = Program((Stage(decl, ()),))

    def update(updates: PyTree, state: Any, params: PyTree | None = None, **_: Any) -> tuple[PyTree, Any]:
        if not decl.stateless:  # a stateless transform takes whatever state it is given back
            check_state(state, decl.state_type, decl.name)
        if decl.uses_params and params is None:
            raise ValueError(f"{decl.name} needs params: call update(updates, state, params)")
        from fadam._execute import run_update  # the executor and the sparse rules build on this module
        from fadam._sparse import check_sparse

        compiled = run_update(program, updates, state, params)
        if compiled is not None:
            return compiled
        if decl.slots:
            grads, first, spec = check_leaves(
                updates, getattr(state, decl.slots[0].name), like_what=f"the {decl.name} state (params)", sparse=True
            )
            slot_lists = [first] + [spec.flatten_up_to(getattr(state, slot.name)) for slot in decl.slots[1:]]
        else:
            grads, _, spec = check_leaves(updates, updates if params is None else params, sparse=True)
            slot_lists = []
        check_sparse(program, grads, spec)
        param_leaves = spec.flatten_up_to(params) if decl.uses_params else [None] * len(grads)
        scalars = decl.scalars(state, grads)
        own, statistics = None, []
        if decl.reduce_statistics is not None:
            given = [spec.flatten_up_to(getattr(state, st.name)) for st in decl.statistics]
            own, statistics = leaf_statistics(decl, scalars, grads, param_leaves, given)
        new_updates, new_slots = eager_stage(decl, scalars, grads, param_leaves, slot_lists, own)
        slot_trees, statistic_trees = ([spec.unflatten(s) for s in found] for found in (new_slots, statistics))
        return spec.unflatten(new_updates), decl.advance(state, slot_trees, scalars, statistic_trees)

    return GradientTransformation(decl.init, ProgramUpdate(update, program))


# ---------------------------------------------------------------------------------------------------------- eager


class _Namespace:
    """The scalars a body reads as attributes (``s.b1``)."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)


class EagerOps:
    """The body's operations on torch tensors: one torch op each, rounding once."""

    @staticmethod
    def sqrt(x: torch.Tensor) -> torch.Tensor:
        """The IEEE square root of a float32 ``x`` (``_mkl_float32``: torch's CPU one is MKL's there, whose last
        bit differs for 1-17% of inputs, depending on the CPU), else torch's."""
        if x.dtype is torch.float32 and _mkl_float32(x):
            return EagerOps.sqrt(x.double()).to(torch.float32)
        # where autograd or torch.func sees the step, derivatives must stay finite where x is 0 (safe_sqrt)
        return torch.sqrt(x) if is_plain(x) else safe_sqrt(x)

    rsqrt = staticmethod(torch.rsqrt)  # 1 / the IEEE square root, on every CPU path of ATen's
    abs = staticmethod(torch.abs)
    sign = staticmethod(torch.sign)
    maximum = staticmethod(torch.maximum)
    minimum = staticmethod(torch.minimum)
    where = staticmethod(torch.where)

    @staticmethod
    def clamp(x: torch.Tensor, low: Any, high: Any) -> torch.Tensor:
        return torch.clamp(x, low, high)

    @staticmethod
    def cast(x: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor | float:
        """``x`` in ``like``'s dtype; a number stays a number (tensor ops round it to their dtype themselves)."""
        if not isinstance(x, torch.Tensor) or x.dtype == like.dtype:
            return x
        return x.to(like.dtype)

    # torch.optim's fused operations, rounded as ATen rounds them (the kernels reproduce that rounding)
    @staticmethod
    def lerp(start: torch.Tensor, end: torch.Tensor, weight: float | torch.Tensor) -> torch.Tensor:
        """``torch.lerp``, but at a weight of 1 (Adam's or Lion's ``1 - b1`` where ``b1`` is 0) ``end + 0 * (end -
        start)`` for every element, as ATen's vector loop computes it: its scalar tail computes ``end - (end - start)
        * 0``, which signs a zero otherwise (``lerp(0, -0, 1)`` is -0 in the loop's body, +0 in a leaf's last
        elements). A 0-d leaf takes its scalars as tensors (``_leaf_scalars``); a tensor weight over a larger leaf
        keeps ``torch.lerp``'s signs there (choosing by its value would cost every such step two more passes)."""
        if isinstance(weight, torch.Tensor):
            weight = weight if weight.dtype == start.dtype else weight.to(start.dtype)
            if start.dim() == 0:
                # (weight - 1) is +0 there: the same value, and the weight's derivative (end - start) for meta-gradients
                return torch.where(weight == 1.0, end + (end - start) * (weight - 1.0), torch.lerp(start, end, weight))
            return torch.lerp(start, end, weight)
        if weight == 1.0:
            return end + (end - start) * 0.0
        return torch.lerp(start, end, weight)

    @staticmethod
    def addcmul(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, value: float | torch.Tensor) -> torch.Tensor:
        """``c + value * a * b``; a tensor ``value`` (which ``addcmul`` takes only as a number) rounds alike."""
        if isinstance(value, torch.Tensor):
            return torch.addcmul(c, a * value.to(a.dtype), b)
        return torch.addcmul(c, a, b, value=value)

    @staticmethod
    def add_scaled(a: torch.Tensor, b: torch.Tensor, alpha: float | torch.Tensor) -> torch.Tensor:
        """``torch.add(a, b, alpha=alpha)``; a tensor ``alpha`` (a number there) through ``addcmul``, rounded alike."""
        if isinstance(alpha, torch.Tensor):
            return torch.addcmul(a, b, alpha.to(b.dtype))
        return torch.add(a, b, alpha=alpha)


EAGER = EagerOps()


def _mkl_float32(x: torch.Tensor) -> bool:
    """Whether torch's square root of the float32 tensor ``x`` is MKL's (on the CPU, where torch links MKL), which
    ``EagerOps.sqrt`` replaces by the IEEE one: MKL's float64 root, within an ulp of the exact one, rounded to float32.
    That is the IEEE float32 root: the exact root of a float32 lies more than ``2**-51`` of its size from every
    midpoint ``M`` between float32s (``x - M**2`` is a nonzero multiple of the last bit of ``M**2``), beyond the reach
    of a float64 ulp (``2**-52`` of it). ``benchmarks/check_sqrt_exhaustive.py`` checks every float32. The kernels
    compute the IEEE root with the machine's instruction, in the pass that needs it."""
    return _TORCH_HAS_MKL and x.device.type == "cpu"


_TORCH_HAS_MKL = torch.backends.mkl.is_available()  # read once: a call is a graph break under torch.compile


def _as_real(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else real_view(x)


def _leaf_scalars(scalars: Scalars, leaf: torch.Tensor, cache: dict) -> _Namespace:
    """The scalars as a body sees them for ``leaf``. A number or a 0-d tensor combined with a leaf of at least one
    dimension rounds to the leaf's dtype alike (a float64 0-d tensor does not promote it), and the generated kernels
    cast every scalar to their dtype the same way. A 0-d leaf would be promoted by a 0-d tensor but not by a number:
    there every scalar is a float64 0-d tensor, so that a 0-d leaf computes alike under ``torch.func.vmap`` (where
    the scalars derived from a batched count are tensors) and outside it."""
    zero_dim = leaf.dim() == 0
    key = (leaf.device, zero_dim)
    found = cache.get(key)
    if found is None:
        found = cache[key] = _Namespace({name: _scalar_for(v, leaf, zero_dim) for name, v in scalars.items()})
    return found


def _own_values(values: dict[str, Any], leaf: torch.Tensor, real: torch.Tensor) -> dict[str, Any]:
    """A leaf's values from its statistics as its body reads them on its reals ``real``: spreads broadcast over them,
    numbers as the step's scalars."""
    numbers = {name: v for name, v in values.items() if not isinstance(v, Spread)}
    found = _leaf_scalars(numbers, real, {}).__dict__
    spreads = {name: v.over(leaf, leaf.is_complex()) for name, v in values.items() if isinstance(v, Spread)}
    return found | spreads


def _scalar_for(value: float | torch.Tensor, leaf: torch.Tensor, zero_dim: bool) -> float | torch.Tensor:
    if not isinstance(value, torch.Tensor):
        return torch.tensor(value, dtype=torch.float64) if zero_dim else value
    if value.device != leaf.device and value.device.type != "cpu":  # leaves on several devices (model parallel)
        return value.to(leaf.device, non_blocking=leaf.device.type != "cpu")
    return for_leaf(value, leaf)


def eager_stage(
    decl: Elementwise,
    scalars: Scalars,
    updates: list[torch.Tensor | None],
    params: list[torch.Tensor | None],
    slots: list[list[torch.Tensor]],
    own: list[dict[str, Any] | None] | None = None,
) -> tuple[list[torch.Tensor | None], list[list[torch.Tensor]]]:
    """Runs ``decl``'s body leaf by leaf with torch ops; returns the updates and each slot's new leaves. A ``None``
    update skips its leaf (torch.optim skips a param without a gradient). Complex leaves run as pairs of reals
    (``torch.view_as_real``), as torch.optim treats them. ``own``: each leaf's values from its statistics
    (``leaf_statistics``)."""
    new_updates: list[torch.Tensor | None] = []
    new_slots: list[list[torch.Tensor]] = [[] for _ in slots]
    cache: dict = {}
    for index, u in enumerate(updates):
        leaves = [s[index] for s in slots]
        if u is None:
            new_updates.append(None)
            for out, leaf in zip(new_slots, leaves):
                out.append(leaf)
            continue
        real = _as_real(u)
        s = _leaf_scalars(scalars, real, cache)
        if decl.reduce_leaf is not None:  # this leaf's own scalars besides the step's
            found = _leaf_scalars(decl.reduce_leaf(u, params[index]), real, {})
            s = _Namespace({**s.__dict__, **found.__dict__})
        elif own is not None:
            s = _Namespace({**s.__dict__, **_own_values(own[index], u, real)})
        if is_sparse(u):  # real: complex sparse updates are refused (fadam._tree.check_leaves)
            from fadam._sparse import sparse_body  # it runs this module's bodies

            result = sparse_body(decl, s, u, params[index], leaves)
        else:
            result = decl.body(EAGER, s, real, _as_real(params[index]), *[_as_real(leaf) for leaf in leaves])
        out_u = result[0]
        if u.is_complex():
            out_u = torch.view_as_complex(out_u.to(real.dtype).contiguous())
        new_updates.append(out_u if out_u.dtype == u.dtype else out_u.to(u.dtype))
        for out, new, leaf in zip(new_slots, result[1:], leaves):
            if new.dtype != _as_real(leaf).dtype:
                new = new.to(_as_real(leaf).dtype)
            out.append(torch.view_as_complex(new.contiguous()) if leaf.is_complex() else new)
    return new_updates, new_slots


# ---------------------------------------------------------------------------------------------------------- programs


class Storage(NamedTuple):
    """How a stage's slots are kept between steps where its state holds ``QuantizedArray`` leaves
    (``fadam.quantize_state``): ``bits`` per element in blocks of ``block`` elements. The other leaves of those slots
    are plain tensors, as ``init`` made them."""

    bits: int
    block: int


class Stage(NamedTuple):
    """One member of a program: a declaration, or an opaque transform (``decl`` ``None``), with the path of its state
    inside the program's state (indices into tuples, keys into dicts, field names of named tuples), and the masks
    that select its leaves, outermost first (``masked``: each takes the tree its mask applies to, the params with the
    leaves of the masks before it replaced by ``MaskedNode``, and gives a bool per leaf of it)."""

    decl: Elementwise | None
    path: tuple[int | str, ...]
    tx: GradientTransformation | None = None
    selections: tuple[Callable[[PyTree], list[bool]], ...] = ()
    # a transform that builds its inner transform at each step (inject_hyperparams): given its state, the inner
    # program, the field of its state that holds the inner state, and its own state after the step but for that field
    expand: Callable[[Any], tuple[Program, str, Any]] | None = None
    storage: Storage | None = None


class Program(NamedTuple):
    """What a transform does, as stages in order."""

    stages: tuple[Stage, ...]

    def prefixed(self, key: int | str) -> Program:
        return Program(tuple(s._replace(path=(key, *s.path)) for s in self.stages))

    def masked(self, selection: Callable[[PyTree], list[bool]], key: str) -> Program:
        """The program applied to the leaves ``selection`` picks, its state under ``key``."""
        return Program(
            tuple(s._replace(path=(key, *s.path), selections=(selection, *s.selections)) for s in self.stages)
        )

    def stored(self, storage: Storage, key: str) -> Program:
        """The program with its slots kept as ``storage`` says, its state under ``key``."""
        return Program(tuple(s._replace(path=(key, *s.path), storage=storage) for s in self.stages))

    @property
    def declared(self) -> bool:
        """Whether a stage is (or may expand into) a declaration: a program of opaque stages has nothing to compile."""
        return any(s.decl is not None or s.expand is not None for s in self.stages)

    def expanded(self, state: Any) -> tuple[Program, Any]:
        """The program with every expanding stage replaced by its inner program for ``state``, and the state with
        those stages' own parts advanced (their inner states are then the inner stages' to update)."""
        stages: list[Stage] = []
        for stage in self.stages:
            if stage.expand is None:
                stages.append(stage)
                continue
            inner, field, advanced = stage.expand(state_at(state, stage.path))
            state = with_state_at(state, stage.path, advanced)
            inner, state_inner = inner.expanded(getattr(advanced, field))
            state = with_state_at(state, (*stage.path, field), state_inner)
            for s in inner.stages:
                stages.append(
                    s._replace(
                        path=(*stage.path, field, *s.path),
                        selections=stage.selections + s.selections,
                        storage=s.storage or stage.storage,
                    )
                )
        return Program(tuple(stages)), state


def program_of(tx: GradientTransformation) -> Program:
    """``tx``'s program: its declared one, or a single opaque stage."""
    found = getattr(tx.update, "program", None)
    return found if found is not None else Program((Stage(None, (), tx),))


def with_program(init: Callable, update: Callable, program: Program) -> GradientTransformation:
    """The transform ``(init, update)``, its update carrying ``program`` where a stage of it is declared."""
    return GradientTransformation(init, ProgramUpdate(update, program) if program.declared else update)


def leaf_selection(stage: Stage, params: PyTree) -> list[bool]:
    """Which of ``params``' leaves ``stage`` applies to."""
    from fadam.combinators._masking import _select  # combinators build on this module

    selected = [True] * optree.tree_structure(params, none_is_leaf=True).num_leaves
    for selection in stage.selections:
        flags = iter(selection(_select(params, selected)))
        selected = [keep and next(flags) for keep in selected]
    return selected


class ProgramUpdate:
    """An ``update`` function that also carries its transform's ``Program``. Calling it is calling ``update``."""

    def __init__(self, update: Callable[..., tuple[PyTree, PyTree]], program: Program) -> None:
        self._update = update
        self.program = program

    def __call__(
        self, updates: PyTree, state: PyTree, params: PyTree | None = None, **extra_args: Any
    ) -> tuple[PyTree, PyTree]:
        return self._update(updates, state, params, **extra_args)


def _listed_fields(decl: Elementwise) -> list[str]:
    """The fields of ``decl``'s state that hold a tree shaped like the params: its slots' and statistics'."""
    return [slot.name for slot in decl.slots] + [st.name for st in decl.statistics]


def join_states(program: Program, states: Sequence[Any]) -> Any | None:
    """One state of ``program`` for the params of ``states`` one after another, where each is the program's state
    for a list of params that took every step together (a leafwise ``page_state``'s chunks): its slot and statistics
    lists joined in order, the rest (counts, carried values) the first state's. ``None`` where the program is not
    made of plain declarations (an opaque, expanding or masked stage) or a state holds those trees in another form."""
    if any(s.decl is None or s.expand is not None or s.selections for s in program.stages):
        return None
    whole = states[0]
    for stage in program.stages:
        fields = _listed_fields(stage.decl)
        if not fields:
            continue
        parts = [state_at(s, stage.path) for s in states]
        if not all(isinstance(getattr(part, name), list) for part in parts for name in fields):
            return None
        joined = {name: [leaf for part in parts for leaf in getattr(part, name)] for name in fields}
        whole = with_state_at(whole, stage.path, state_at(whole, stage.path)._replace(**joined))
    return whole


def split_state(program: Program, whole: Any, like: Sequence[Any]) -> list[Any]:
    """The states that ``join_states(program, like)`` joined, taken from ``whole`` (that joined state after a step):
    each holds its own part of the slot and statistics lists and ``whole``'s counts and carried values."""
    fields: dict[tuple[int | str, ...], list[str]] = {}  # per state path of a stage with state: its listed fields
    for stage in program.stages:
        if not stage.decl.stateless:
            fields.setdefault(stage.path, []).extend(_listed_fields(stage.decl))
    found = []
    start = 0
    for state in like:
        count = 0
        for path, names in fields.items():
            part = state_at(whole, path)
            if names:
                count = len(getattr(state_at(state, path), names[0]))
                part = part._replace(**{name: getattr(part, name)[start : start + count] for name in names})
            state = with_state_at(state, path, part)
        found.append(state)
        start += count
    return found


def state_at(state: Any, path: tuple[int | str, ...]) -> Any:
    for key in path:
        state = getattr(state, key) if isinstance(key, str) and hasattr(state, "_fields") else state[key]
    return state


def with_state_at(state: Any, path: tuple[int | str, ...], value: Any) -> Any:
    """``state`` with the part at ``path`` replaced (tuples, named tuples and dicts rebuilt, the rest shared)."""
    if not path:
        return value
    key, rest = path[0], path[1:]
    if isinstance(key, str) and hasattr(state, "_fields"):
        return state._replace(**{key: with_state_at(getattr(state, key), rest, value)})
    if isinstance(state, dict):
        return {**state, key: with_state_at(state[key], rest, value)}
    items = list(state)
    items[key] = with_state_at(items[key], rest, value)
    return type(state)(*items) if hasattr(state, "_fields") else tuple(items)


# ---------------------------------------------------------------------------------------------------------- tracing


class Node:
    """A value in a traced body: an input, a scalar, a constant or an operation on earlier nodes."""

    __slots__ = ("args", "boolean", "elementwise", "graph", "index", "op", "value")

    def __init__(self, graph: Graph, op: str, args: tuple = (), value: Any = None, elementwise: bool = True) -> None:
        self.graph, self.op, self.args, self.value = graph, op, args, value
        self.elementwise = elementwise
        self.boolean = op in _COMPARISONS
        self.index = len(graph.nodes)
        graph.nodes.append(self)

    def _binary(self, op: str, other: Any, swap: bool = False) -> Node:
        other = self.graph.lift(other)
        a, b = (other, self) if swap else (self, other)
        return self.graph.apply(op, a, b)

    def __add__(self, other: Any) -> Node:
        return self._binary("add", other)

    def __radd__(self, other: Any) -> Node:
        return self._binary("add", other, swap=True)

    def __sub__(self, other: Any) -> Node:
        return self._binary("sub", other)

    def __rsub__(self, other: Any) -> Node:
        return self._binary("sub", other, swap=True)

    def __mul__(self, other: Any) -> Node:
        return self._binary("mul", other)

    def __rmul__(self, other: Any) -> Node:
        return self._binary("mul", other, swap=True)

    def __truediv__(self, other: Any) -> Node:
        return self._binary("div", other)

    def __rtruediv__(self, other: Any) -> Node:
        # torch computes ``number / tensor`` as ``tensor.reciprocal() * number``: two roundings, traced as such
        return self.graph.apply("mul", self.graph.apply("reciprocal", self), other)

    def __neg__(self) -> Node:
        return self.graph.apply("neg", self)

    def __lt__(self, other: Any) -> Node:
        return self._binary("lt", other)

    def __gt__(self, other: Any) -> Node:
        return self._binary("gt", other)

    def __le__(self, other: Any) -> Node:
        return self._binary("le", other)

    def __ge__(self, other: Any) -> Node:
        return self._binary("ge", other)

    def __bool__(self) -> bool:
        raise TypeError("a traced body cannot branch on an element's value: use o.where")


_COMPARISONS = frozenset({"lt", "gt", "le", "ge"})


class Graph:
    """The nodes of a traced program, in order of creation (every node's arguments come before it)."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.inputs: list[Node] = []
        self.scalars: list[str] = []
        self.leaf_scalars: list[str] = []
        self.operands: list[str] = []  # the leaves' spreads, read after the outputs in a leaf's row
        self._scalar_nodes: dict[str, Node] = {}

    def input(self, name: str) -> Node:
        node = Node(self, "input", value=name)
        self.inputs.append(node)
        return node

    def scalar(self, name: str) -> Node:
        return self._named(name, "scalar", self.scalars)

    def leaf_scalar(self, name: str) -> Node:
        """A scalar with a value per leaf (a leaf reduction's)."""
        return self._named(name, "leaf_scalar", self.leaf_scalars)

    def operand(self, name: str) -> Node:
        """A leaf's ``Spread``: an element value read through its ``Spread.indexing``, whose ``(inner, count)``
        are the node's arguments, leaf scalars named ``<name>:inner`` and ``<name>:count``."""
        if name not in self._scalar_nodes:
            indexing = (self.leaf_scalar(f"{name}:inner"), self.leaf_scalar(f"{name}:count"))
            self.operands.append(name)
            self._scalar_nodes[name] = Node(self, "operand", indexing, value=len(self.operands) - 1)
        return self._scalar_nodes[name]

    def _named(self, name: str, op: str, names: list[str]) -> Node:
        """The node of a named scalar, created on first use; ``value`` is its index in ``names``."""
        if name not in self._scalar_nodes:
            names.append(name)
            self._scalar_nodes[name] = Node(self, op, value=len(names) - 1, elementwise=False)
        return self._scalar_nodes[name]

    def lift(self, value: Any) -> Node:
        if isinstance(value, Node):
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"a traced body met a {type(value).__name__}; expected numbers and its own values")
        return Node(self, "const", value=float(value), elementwise=False)

    def apply(self, op: str, *args: Any) -> Node:
        nodes = tuple(self.lift(a) for a in args)
        if not any(n.elementwise for n in nodes):
            raise TypeError(
                f"{op} of scalars only in a traced body: compute it in the prologue, once per step in double precision"
            )
        return Node(self, op, nodes)


class TraceOps:
    """The body's operations on traced nodes."""

    def __init__(self, graph: Graph) -> None:
        self._graph = graph

    def sqrt(self, x: Node) -> Node:
        return self._graph.apply("sqrt", x)

    def rsqrt(self, x: Node) -> Node:
        return self._graph.apply("rsqrt", x)

    def abs(self, x: Node) -> Node:
        return self._graph.apply("abs", x)

    def sign(self, x: Node) -> Node:
        return self._graph.apply("sign", x)

    def maximum(self, a: Any, b: Any) -> Node:
        return self._graph.apply("maximum", a, b)

    def minimum(self, a: Any, b: Any) -> Node:
        return self._graph.apply("minimum", a, b)

    def where(self, condition: Node, a: Any, b: Any) -> Node:
        return self._graph.apply("where", condition, a, b)

    def clamp(self, x: Node, low: Any, high: Any) -> Node:
        return self._graph.apply("clamp", x, low, high)

    def cast(self, x: Any, like: Node) -> Any:
        return _cast(self._graph, x, like)

    def lerp(self, start: Node, end: Node, weight: Any) -> Node:
        return self._graph.apply("lerp", start, end, weight)

    def addcmul(self, c: Node, a: Node, b: Node, value: Any) -> Node:
        return self._graph.apply("addcmul", c, a, b, value)

    def add_scaled(self, a: Node, b: Node, alpha: Any) -> Node:
        return self._graph.apply("add_scaled", a, b, alpha)


class Traced(NamedTuple):
    """A segment of a program traced into one graph: what a kernel reads and writes per element."""

    graph: Graph
    reads_params: bool
    outputs: tuple[Node, ...]  # new slots of every stage in order, then the update (or the new param, applying)
    applies: bool  # the last output is p + u, the new param


@functools.lru_cache(maxsize=256)
def trace(decls: tuple[Elementwise, ...], applies: bool) -> Traced:
    """Traces consecutive declarations into one graph. Inputs, in order: ``u``, then ``p`` if any stage reads the
    params or the result is applied, then each stage's slots. Scalars are named ``<stage>.<name>``. A program's
    trace is kept (tracing runs each prologue once, about a millisecond) for as long as its declarations are in use:
    a transform rebuilt at every step (``inject_hyperparams``) traces again, into the same kernel."""
    graph = Graph()
    ops = TraceOps(graph)
    u = graph.input("u")
    reads_params = applies or any(d.uses_params for d in decls)
    p = graph.input("p") if reads_params else None
    slot_inputs = [[graph.input(f"{i}.{slot.name}") for slot in d.slots] for i, d in enumerate(decls)]
    outputs: list[Node] = []
    for i, decl in enumerate(decls):
        names, leaf_names, operands = _scalar_names(decl)
        s = _Namespace(
            {name: graph.scalar(f"{i}.{name}") for name in names}
            | {name: graph.leaf_scalar(f"{i}.{name}") for name in leaf_names}
            | {name: graph.operand(f"{i}.{name}") for name in operands}
        )
        result = decl.body(ops, s, u, p if decl.uses_params else None, *slot_inputs[i])
        # each stage returns its update in its input's dtype and its slots in theirs (eager_stage)
        u = _cast(graph, graph.lift(result[0]), u)
        outputs.extend(_cast(graph, graph.lift(r), slot) for r, slot in zip(result[1:], slot_inputs[i]))
    outputs.append(graph.apply("add", p, u) if applies else u)
    return Traced(graph, reads_params, tuple(outputs), applies)


def _cast(graph: Graph, x: Any, like: Node) -> Any:
    """``x`` in ``like``'s dtype (a number stays a number)."""
    if not isinstance(x, Node) or not x.elementwise or x is like:
        return x
    return graph.apply("cast", x, like)


def _scalar_names(decl: Elementwise) -> tuple[list[str], list[str], list[str]]:
    """The names of ``decl``'s scalars, per step and per leaf, and of its spreads, found by running its prologue on a
    first step (the names never depend on the count), its reduction on no leaves and its leaf reduction (or its
    statistics) on a one-element leaf."""
    count = safe_increment(zero_count()) if decl.shares_count else zero_count() if decl.counted else None
    first = decl.prologue(count, *(c.init() for c in decl.carried))
    names = list(first)
    if decl.reduce is not None:
        names += list(decl.reduce([]))
    leaf = torch.ones(1)
    if decl.reduce_statistics is not None:
        own, _ = decl.reduce_statistics(first, leaf, leaf, *(st.init(leaf) for st in decl.statistics))
        spreads = [name for name, v in own.items() if isinstance(v, Spread)]
        return names, [name for name in own if name not in spreads], spreads
    leaf_names = [] if decl.reduce_leaf is None else list(decl.reduce_leaf(leaf, leaf))
    return names, leaf_names, []


def scalar_values(
    per_stage: Sequence[Scalars], graph: Graph, device: torch.device | None = None
) -> list[float] | torch.Tensor:
    """The values of a traced graph's scalars, in the graph's order, as doubles (a kernel casts them once): Python
    floats, or with ``device`` one float64 tensor there (``device_vector``), which reads nothing on the host."""
    values = []
    for name in graph.scalars:
        stage, _, key = name.partition(".")
        values.append(per_stage[int(stage)][key])
    if device is not None:
        return device_vector(values, device)
    return [float(value) for value in values]
