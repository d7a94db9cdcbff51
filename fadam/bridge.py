"""The torch.optim bridge: ``fadam.Optimizer`` runs any fadam transform as a ``torch.optim.Optimizer`` for
module-based training loops, and ``state_from_torch`` / ``state_to_torch`` convert optimizer state between
torch.optim's per-param dicts and fadam's functional state, so a run can switch sides mid-way.
"""

from __future__ import annotations

import copy
import inspect
import pickle
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import optree
import torch
from torch.optim.optimizer import _device_dtype_check_for_fused, _get_capturable_supported_devices, required

from fadam._base import GradientTransformation, _write_into, step
from fadam._bitsandbytes_state import adam_stand_in, as_bitsandbytes, as_torch_adam, is_bitsandbytes
from fadam._dispatch import first_overlap, is_sparse
from fadam._execute import backend
from fadam._lbfgs_state import lbfgs_from_torch, lbfgs_to_torch
from fadam._torch_aliases import check_sparse_adam_args, sparse_adam
from fadam._tree import PyTree, path_str, tree_flatten, tree_leaves
from fadam.aliases import adagrad, adam, adamw, sgd
from fadam.combinators._capturable import capturable
from fadam.paging import PagedState
from fadam.quantization import QuantizedArray
from fadam.quantization._full_precision import dequantized, full_precision
from fadam.transforms._adadelta import ScaleByAdadeltaState
from fadam.transforms._adafactor_torch import ScaleByAdafactorTorchState
from fadam.transforms._adam import ScaleByAdamState, ScaleByAmsgradState
from fadam.transforms._adam_variants import ScaleByAdamaxState, ScaleByNadamState, ScaleByRadamState
from fadam.transforms._asgd import ScaleByAsgdState, _rates, _scalar_dtype
from fadam.transforms._lbfgs import LbfgsState
from fadam.transforms._momentum import TraceState
from fadam.transforms._muon import ScaleByMuonState
from fadam.transforms._rms import ScaleByRmsState, ScaleByRssState, ScaleByRStdDevState
from fadam.transforms._rprop import ScaleByRpropState
from fadam.transforms._schedule_free import is_schedule_free, schedule_free_eval_params, schedule_free_train_params

__all__ = ["Optimizer", "SparseAdam", "state_from_torch", "state_to_torch"]

TransformOrFactory = GradientTransformation | Callable[..., GradientTransformation]

_LR_KEYS = ("learning_rate", "lr")
# torch.optim's implementation flags, with torch's defaults: group options of every group, never factory arguments
_FLAGS: dict[str, bool | None] = {"foreach": None, "fused": None, "capturable": False, "differentiable": False}
# what a copy or a pickle carries besides torch.optim's defaults, state and param_groups; the transforms of factory
# groups are rebuilt from their recipes and the option values they were built with
_CARRIED = (
    "_specs",
    "_modes",
    "_base_lrs",
    "_given",
    "tx_states",
    "_recipes",
    "_built_with",
    "_fresh",
    "_flags",
    "_shared_options",
)
# the optree namespace in which this module flattens dicts in insertion order: the order params were given in
_GIVEN_ORDER = "fadam.bridge"


def _lr_value(lr: float | torch.Tensor) -> float:
    return float(lr.detach()) if isinstance(lr, torch.Tensor) else float(lr)


def _map_states(state: PyTree, fn: Callable[[Any], Any | None]) -> PyTree:
    """Rebuilds ``state``, replacing every node for which ``fn`` returns a value (containers are walked)."""
    replaced = fn(state)
    if replaced is not None:
        return replaced
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        return type(state)(*(_map_states(x, fn) for x in state))
    if isinstance(state, (tuple, list)):
        return type(state)(_map_states(x, fn) for x in state)
    if isinstance(state, dict):
        return {k: _map_states(v, fn) for k, v in state.items()}
    return state


def _injected_lr(state: PyTree) -> torch.Tensor | None:
    """The learning rate of an ``inject_hyperparams`` state (a node with a ``hyperparams`` dict), found by duck
    typing so that the bridge does not depend on that wrapper."""
    found: list[torch.Tensor] = []

    def visit(node: Any) -> None:
        hyperparams = getattr(node, "hyperparams", None)
        if isinstance(hyperparams, dict) and not found:
            for key in _LR_KEYS:
                if key in hyperparams:
                    found.append(hyperparams[key])
                    return
        return None

    _map_states(state, visit)
    return found[0] if found else None


def _with_injected_lr(state: PyTree, lr: float | torch.Tensor) -> PyTree:
    def replace(node: Any) -> Any | None:
        hyperparams = getattr(node, "hyperparams", None)
        if not isinstance(hyperparams, dict) or not any(k in hyperparams for k in _LR_KEYS):
            return None
        key = next(k for k in _LR_KEYS if k in hyperparams)
        return node._replace(hyperparams={**hyperparams, key: _stored_like(lr, hyperparams[key])})

    return _map_states(state, replace)


def _with_injected(state: PyTree, values: dict[str, Any]) -> PyTree:
    """``state`` with each of ``values`` written over the injected hyperparameter of that name, where the group's
    factory is an ``inject_hyperparams`` one: its transform reads them from its state, not from its arguments."""
    hyperparams = getattr(state, "hyperparams", None)
    if not isinstance(hyperparams, dict) or not any(name in hyperparams for name in values):
        return state
    written = {name: _stored_like(values[name], old) for name, old in hyperparams.items() if name in values}
    return state._replace(hyperparams={**hyperparams, **written})


def _stored_like(value: Any, old: Any) -> Any:
    """``value`` in the dtype and on the device of the injected hyperparameter ``old`` it replaces."""
    return torch.as_tensor(value, dtype=old.dtype, device=old.device) if isinstance(old, torch.Tensor) else value


# --- where each leaf of a functional state belongs ------------------------------------------------------------------


def _given_order(tree: PyTree) -> list[int]:
    """For each leaf of ``tree`` in optree's order, its position in the order the tree was built: optree flattens
    dicts with their keys sorted ("10.weight" before "2.weight"), the params were given in insertion order."""
    with optree.dict_insertion_ordered(True, namespace=_GIVEN_ORDER):
        given = optree.tree_paths(tree, none_is_leaf=True, namespace=_GIVEN_ORDER)
    position = {path: i for i, path in enumerate(given)}
    return [position[path] for path in optree.tree_paths(tree, none_is_leaf=True)]


class _Slot(NamedTuple):
    """Where one leaf of a functional state sits relative to the params."""

    param: int | None  # the params-tree leaf whose state it is; None for a leaf shared by all params (a count)
    key: str  # its path in the state without the param's own part: the same for every param
    owner: type | None  # the state type whose field holds it (for a param's leaf: the param-shaped field)
    field: str | None  # that field's name
    whole: bool  # the leaf is the param's whole entry in that field, not a part of a quantized one


def _is_entry(part: Any) -> bool:
    """Whether ``part`` can be one param's entry in a field shaped like the params: a tensor, a quantized tensor or
    nothing (so that a chain's tuple of states is not taken for a field when the params are a tuple as long)."""
    if part is None or isinstance(part, (torch.Tensor, QuantizedArray)):
        return True
    return optree.tree_structure(part, none_is_leaf=True).num_leaves == 0


def _per_param(node: Any, params_spec: optree.PyTreeSpec) -> list[Any] | None:
    """``node``'s entry for each param when it is shaped like the params (a moment, a trace), else None."""
    if optree.tree_is_leaf(node, none_is_leaf=True):
        return None
    try:
        parts = params_spec.flatten_up_to(node)
    except ValueError:
        return None
    return parts if all(_is_entry(part) for part in parts) else None


def _slots(state: PyTree, params_spec: optree.PyTreeSpec) -> list[_Slot]:
    """A ``_Slot`` for each leaf of ``state`` (flattened with None as a leaf), in order."""
    owners: list[tuple[int | None, int]] = []  # (param, depth of the param-shaped node holding the leaf)

    def walk(node: Any, depth: int) -> None:
        parts = _per_param(node, params_spec)
        if parts is not None:
            for index, part in enumerate(parts):
                owners.extend([(index, depth)] * optree.tree_structure(part, none_is_leaf=True).num_leaves)
        elif optree.tree_is_leaf(node, none_is_leaf=True):
            owners.append((None, depth))
        else:
            for child in optree.tree_flatten_one_level(node, none_is_leaf=True)[0]:
                walk(child, depth + 1)

    walk(state, 0)
    param_depths = [len(accessor) for accessor in params_spec.accessors()]
    slots = []
    for accessor, (param, depth) in zip(optree.tree_accessors(state, none_is_leaf=True), owners):
        entries = tuple(accessor)
        if param is None:  # a shared leaf: keyed by its whole path, held by its parent node
            key, holder, whole = entries, entries[-1:], False
        else:  # the param's own part of the path is cut out; the node holding the param-shaped field is above it
            end = depth + param_depths[param]
            key, holder, whole = entries[:depth] + entries[end:], entries[depth - 1 : depth], len(entries) == end
        field = getattr(holder[0], "field", None) if holder else None  # NamedTuple entries have one
        owner = holder[0].type if field is not None else None
        slots.append(_Slot(param, optree.PyTreeAccessor(key).codify("state"), owner, field, whole))
    return slots


def _leaf_layout(leaves: list[Any], slots: list[_Slot]) -> list[tuple[Any, ...]]:
    """What a state's leaves hold, in order: whose and which field, shape and dtype (not where in the chain)."""
    return [
        (slot.param, slot.owner, slot.field, tuple(getattr(leaf, "shape", ())), getattr(leaf, "dtype", type(leaf)))
        for leaf, slot in zip(leaves, slots)
    ]


def _checked(where: str, new: Any, old: Any) -> Any:
    """``new``, checked to replace the state leaf ``old`` (same kind, shape and dtype), copied to ``old``'s device."""
    if old is None or not isinstance(old, torch.Tensor):
        if type(new) is not type(old):
            raise ValueError(f"{where}: expected {type(old).__name__}, got {type(new).__name__}")
        return new
    if not isinstance(new, torch.Tensor):
        raise ValueError(f"{where}: expected a tensor, got {type(new).__name__}")
    if new.shape != old.shape or new.dtype != old.dtype:
        raise ValueError(
            f"{where}: expected shape {tuple(old.shape)} and dtype {old.dtype}, got {tuple(new.shape)} and {new.dtype}"
        )
    return new.to(old.device, copy=True)  # a copy: later donating steps must not write into the caller's tensors


# --- params that must not be updated twice --------------------------------------------------------------------------


def _check_no_overlap(labelled: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Refuses two different params whose memory overlaps (views of one buffer): each would be updated on its own,
    from its own gradient, and the shared elements would get both updates."""
    found = first_overlap([p for _, p in labelled], [], [])
    if found is not None:
        (_, first), (_, second) = found
        raise ValueError(
            f"{labelled[first][0]} and {labelled[second][0]} overlap in memory (views of one buffer) and would each be "
            "updated on their own; optimize the buffer they share, or give them separate storage"
        )


class _Given(NamedTuple):
    """A group's params as they were given, a param listed twice included: what torch.optim numbers."""

    positions: list[int]  # for each entry given, its param's position in the group's params (each listed once)
    names: list[Any] | None  # the names given, for named params


def _per_distinct(given: _Given, indices: Sequence[int]) -> list[int]:
    """For each of a group's params, the value ``indices`` (one per entry given) holds at its first entry."""
    first: dict[int, int] = {}
    for position, index in zip(given.positions, indices):
        first.setdefault(position, index)
    return [first[position] for position in range(len(first))]


def _first_entries(params: Sequence[Any]) -> tuple[list[int], list[int]]:
    """Which of ``params`` are listed for the first time (their indices), and for each its position among those
    (what is not a tensor counts as first, for torch.optim to refuse)."""
    position_of: dict[int, int] = {}  # id of a tensor -> its position among the first entries
    first: list[int] = []
    positions = []
    for index, p in enumerate(params):
        if isinstance(p, torch.Tensor) and id(p) in position_of:
            positions.append(position_of[id(p)])
            continue
        if isinstance(p, torch.Tensor):
            position_of[id(p)] = len(first)
        positions.append(len(first))
        first.append(index)
    return first, positions


def _labelled(params: Sequence[Any], names: Sequence[Any] | None) -> list[tuple[str, Any]]:
    """Each param with its path in the group's pytree: its name, or its position."""
    return [(path_str((names[i] if names is not None else i,)), p) for i, p in enumerate(params)]


# --- group options: a factory's arguments and torch.optim's flags, read from each param group -------------------------


class _Recipe(NamedTuple):
    """How a factory group's transform is built: ``factory(<lr_name>=<the group's lr>, **options)``."""

    factory: Callable[..., GradientTransformation]
    lr_name: str  # "lr", or "learning_rate" for the factories that take it so (sign_sgd)
    names: tuple[str, ...]  # the group options handed to the factory: its other named arguments


def _factory_name(factory: Callable[..., Any]) -> str:
    inner = getattr(factory, "func", factory)  # a functools.partial names its function
    return getattr(inner, "__qualname__", type(inner).__name__)


def _recipe(factory: Callable[..., Any], given: Iterable[str] = ()) -> tuple[_Recipe, dict[str, Any]]:
    """``factory``'s recipe and its options' defaults (torch.optim's ``required`` for one without). ``given`` are
    option names passed to ``fadam.Optimizer``: a factory taking ``**kwargs`` takes them as options too; otherwise
    one it does not take is refused."""
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a callable that Python cannot inspect: it is called with lr only
        parameters = {}
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    named = {name: p for name, p in parameters.items() if p.kind in kinds}
    lr_name = "lr" if "lr" in named or "learning_rate" not in named else "learning_rate"
    defaults = {
        name: required if p.default is inspect.Parameter.empty else p.default
        for name, p in named.items()
        if name != lr_name and name not in _FLAGS
    }
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    unknown = [name for name in given if name not in defaults]
    if unknown and not takes_kwargs:
        raise TypeError(
            f"{_factory_name(factory)} takes no option {', '.join(map(repr, unknown))}; its options are "
            f"{', '.join(defaults) or 'none'} (and lr, foreach, fused, capturable, differentiable)"
        )
    return _Recipe(factory, lr_name, (*defaults, *unknown)), defaults


def _lr_default(recipe: _Recipe) -> float | torch.Tensor:
    """The default learning rate of a factory (``fadam.adam``'s 1e-3, torch.optim.Adam's); raises without one."""
    try:
        default = inspect.signature(recipe.factory).parameters[recipe.lr_name].default
    except (TypeError, ValueError, KeyError):
        default = inspect.Parameter.empty
    if default is inspect.Parameter.empty or default is None or callable(default):
        raise ValueError(
            f"{_factory_name(recipe.factory)} has no default learning rate, and a transform factory needs one: pass "
            "lr= to fadam.Optimizer or the group"
        )
    return default


def _option_values(group: dict[str, Any], recipe: _Recipe, where: str) -> dict[str, Any]:
    missing = [name for name in recipe.names if name not in group]
    if missing:
        raise ValueError(f"{where} lacks the option {missing[0]!r} of {_factory_name(recipe.factory)}")
    return {name: group[name] for name in recipe.names}


def _same(a: Any, b: Any) -> bool:
    """Whether option values ``a`` and ``b`` build the same transform: equal numbers, flags and tuples of them, the
    same tensor (a transform reads a tensor's current value at each step)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _kind(value: Any) -> Any:
    """What an option's value decides of a factory's chain, as fadam's factories branch on their arguments: its type,
    and for a number whether it is 0 (``weight_decay=0`` adds no decay transform); a flag or any other value as it is.
    Values of one kind build transforms whose states have one layout."""
    if isinstance(value, (tuple, list)):
        return type(value), tuple(_kind(x) for x in value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return type(value), value == 0
    if isinstance(value, torch.Tensor):
        return torch.Tensor, value.dtype, value.device
    try:
        hash(value)
    except TypeError:
        return id(value)
    return value


def _live_lr(group: dict[str, Any]) -> Callable[[torch.Tensor], float | torch.Tensor]:
    """The learning-rate schedule of a factory group: its current ``lr`` at each step (a tensor as it is in a
    differentiable group, so that gradients reach it, and in a capturable one, so that it is not read on the host and
    a captured graph reads its current value)."""

    def lr(count: torch.Tensor) -> float | torch.Tensor:
        value = group["lr"]
        as_tensor = group["differentiable"] or group["capturable"]
        return value if as_tensor and isinstance(value, torch.Tensor) else _lr_value(value)

    return lr


def _build(recipe: _Recipe, values: dict[str, Any], group: dict[str, Any], where: str) -> GradientTransformation:
    """The transform of a factory group for option ``values``; the factory's own checks name the group."""
    try:
        tx = recipe.factory(**{recipe.lr_name: _live_lr(group)}, **values)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{where}: {error}") from error
    if not isinstance(tx, GradientTransformation):
        raise TypeError(f"{where}: tx(lr=...) returned a {type(tx).__name__}, expected a GradientTransformation")
    return tx


def _flags_of(group: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(group[name] for name in _FLAGS)


def _check_flags(group: dict[str, Any], where: str) -> None:
    """torch.optim's checks of ``foreach``, ``fused``, ``capturable`` and ``differentiable``, with its messages;
    ``capturable`` takes CPU params too, which step by the same route (``fadam.capturable``)."""
    for name, default in _FLAGS.items():
        value = group[name]
        if not (isinstance(value, bool) or (default is None and value is None)):
            raise TypeError(f"{where}: {name} must be a bool{' or None' if default is None else ''}, got {value!r}")
    if group["fused"] and group["differentiable"]:
        raise RuntimeError(f"{where}: `fused` does not support `differentiable`")
    if group["fused"] and group["foreach"]:
        raise RuntimeError(f"{where}: `fused` and `foreach` cannot be `True` together.")
    if group["foreach"] and group["differentiable"]:
        raise RuntimeError(
            f"{where}: `foreach` and `differentiable` cannot be `True` together (_foreach ops don't support autograd)"
        )
    for p in group["params"]:
        if group["fused"]:
            try:
                _device_dtype_check_for_fused(p)
            except RuntimeError as error:
                raise RuntimeError(f"{where}: {error}") from None
        devices = ["cpu", *_get_capturable_supported_devices()] if group["capturable"] else []
        if devices and p.device.type not in devices:
            raise ValueError(
                f"{where}: capturable=True needs the step counts on the params' device: If capturable=True, params "
                f"and state_steps must be on supported devices: {devices}; got a param on {p.device}"
            )


def _check_tensor_options(group: dict[str, Any], spec: Any) -> None:
    """torch.optim's checks of a tensor ``lr`` (one element), and of ``fadam.adam``'s and ``fadam.adamw``'s tensor
    ``lr`` and ``betas`` with ``foreach=True``, which torch.optim.Adam and AdamW refuse unless ``capturable``: a
    drop-in refuses what the class it stands for refuses, with its messages."""
    lr = group["lr"]
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if getattr(spec, "func", spec) not in (adam, adamw) or not group["foreach"] or group["capturable"]:
        return
    if isinstance(lr, torch.Tensor):
        raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")
    betas = group.get("betas")
    if isinstance(betas, (tuple, list)) and betas and isinstance(betas[0], torch.Tensor):
        raise ValueError("betas[0] as a Tensor is not supported for capturable=False and foreach=True")


# torch.optim's refusals of sparse gradients with fused=True, in the words of the class each alias stands for
_FUSED_SPARSE = {
    sgd: "`_fused_sgd` does not support sparse gradients",
    adagrad: "`fused` does not support sparse grad or complex param",
}


def _check_fused_sparse(group: dict[str, Any], spec: Any, where: str) -> None:
    """Refuses sparse gradients in a ``fused=True`` group, as torch.optim does: its fused kernels take none."""
    if group["fused"] and any(is_sparse(p.grad) for p in group["params"]):
        message = _FUSED_SPARSE.get(getattr(spec, "func", spec), "fused=True does not support sparse gradients")
        raise RuntimeError(f"{where}: {message}")


def _run_as(tx: GradientTransformation, group: dict[str, Any]) -> GradientTransformation:
    """The transform a group's state is made and stepped with: ``fadam.capturable(tx)`` in a capturable group (its
    counts on the params' device, a step that reads nothing on the host and writes its state in place), else ``tx``.
    A transform that minimizes a closure is stepped as it is: it evaluates the loss on the host."""
    return capturable(tx) if group["capturable"] and not _minimizes(tx) else tx


def _backend_of(group: dict[str, Any]) -> str:
    """The fadam backend that stands for the group's torch.optim implementation flags: ``fused`` torch's fused
    kernel where the alias has one, else fadam's generated kernel ("auto"); ``foreach`` one call over all the group's
    leaves, never torch's fused kernels ("kernel"); the for-loop (``foreach=False`` or ``fused=False``) and
    ``differentiable`` torch ops per param ("eager"); neither set: "auto"."""
    if group["differentiable"]:
        return "eager"
    if group["fused"]:
        return "auto"
    if group["foreach"]:
        return "kernel"
    if group["foreach"] is False or group["fused"] is False:
        return "eager"
    return "auto"


def _minimizes(tx: GradientTransformation) -> bool:
    """Whether ``tx`` minimizes a loss closure (``fadam.lbfgs``): its update takes ``value_fn`` and gives the new
    params themselves."""
    return callable(getattr(tx.update, "minimize", None))


def _default_options(tx: Any, options: dict[str, Any]) -> dict[str, Any]:
    """The optimizer-wide values of the default factory's options: its own defaults, overridden by those given."""
    if isinstance(tx, GradientTransformation):
        if options:
            raise TypeError(
                f"{', '.join(map(repr, options))} are options of a transform factory, and a ready transform is built "
                "with its own: pass a factory (fadam.adam, not fadam.adam(...)) to set them"
            )
        return {}
    if not callable(tx):
        return {}  # refused with the group
    _, defaults = _recipe(tx, options)
    return {**defaults, **options}


def _saved_options(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved param group's options: what torch.optim loads into the group, all but its params and fadam's state."""
    return {k: v for k, v in saved.items() if k not in ("params", "param_names", "tx_state")}


class Optimizer(torch.optim.Optimizer):
    r"""A ``torch.optim.Optimizer`` that runs a fadam transform: for module-based training loops.

    ``params`` is what torch.optim accepts: ``model.parameters()``, ``model.named_parameters()`` (the names become
    the keys of the pytree the transform sees, so masks and ``partition`` labels can use them) or a list of param-group
    dicts, each of which may carry its own ``tx``, ``lr`` and options. ``step`` updates the params in place, as
    torch.optim does (through ``fadam.step(..., donate=True)``, so the aliases with a fused torch kernel run it).

    A param listed twice in a group is stepped once, with a warning (torch.optim warns too, and its for-loop, foreach
    and fused Adam then give three different results); two different params whose memory overlaps (views of one
    buffer, which would each be updated on their own) are refused. Tied weights are one Parameter:
    ``model.parameters()`` lists them once.

    ``param_groups[i]["lr"]`` drives the step, so every ``torch.optim.lr_scheduler`` works. How it reaches the
    transform depends on what ``tx`` is:

    - a **factory** (``fadam.adamw``, ``functools.partial(fadam.sgd, momentum=0.9)``, any callable taking ``lr``,
      or ``learning_rate`` as ``fadam.sign_sgd`` does): it is built with a learning-rate schedule that reads the
      group's current ``lr``. Exact: this is the way to follow a torch.optim optimizer and its scheduler step for
      step. Without ``lr``, the factory's default (``fadam.adam``'s 1e-3, as ``torch.optim.Adam``'s).
    - a transform whose state holds injected hyperparameters (``fadam.inject_hyperparams``) with a ``learning_rate``
      or ``lr`` entry: the group's ``lr`` is written there before each step (and read from there by default).
    - any other transform: fadam cannot read the learning rate it was built with, so ``lr`` must be given and be that
      one (a group with its own ``tx`` gives its own ``lr``); ``param_groups[i]["lr"]`` then reports it (fadam cannot
      check it), and when a scheduler changes it the updates are multiplied by ``lr / lr_at_construction`` (exact
      while it is unchanged).

    **Group options.** With a factory, every other argument it takes is a group option, as in torch.optim: each
    ``param_groups[i]`` holds it (``betas``, ``eps``, ``weight_decay``, ``amsgrad``, ``maximize`` for
    ``fadam.adam``; ``momentum``, ``dampening``, ``nesterov`` for ``fadam.sgd``; ...), with the value the group sets,
    else the one given to ``fadam.Optimizer`` (``fadam.Optimizer(params, fadam.adam, lr=1e-3, betas=(0.9, 0.99))``),
    else the factory's default; a group's own factory takes the options given to ``fadam.Optimizer`` that it has. A
    value written between steps (by a scheduler: ``OneCycleLR`` and ``CyclicLR`` cycle ``betas`` or ``momentum``)
    drives the next step exactly as it would drive torch.optim's: the group's transform is rebuilt from its factory
    when an option's value changes (a factory call, no kernel compilation) and keeps its state. A change that the
    state's layout follows (``amsgrad``, a ``momentum`` of 0 becoming one, a ``mu_dtype``) is taken before the first
    step and refused after it, naming the option; a chain that gains or loses a stateless member (``maximize``, a
    coupled ``weight_decay`` of 0) keeps its state. Every group's options are read and checked (by the factory, with
    torch.optim's messages) before any group steps. A key that the group's transform does not take is kept and
    ignored, as by torch.optim; so are options with a ready transform, which is built with its own (passing options
    with one to ``fadam.Optimizer`` raises).

    **A loss closure.** ``fadam.lbfgs`` (``fadam.Optimizer(params, fadam.lbfgs, lr=1, ...)``) is stepped as
    ``torch.optim.LBFGS``: ``step(closure)`` needs the closure, runs it at every point the transform evaluates (the
    params set to that point) and leaves the params where torch's would be, bit for bit; ``max_eval`` of ``None``
    becomes ``max_iter * 5 // 4`` in the group, and the optimizer takes one param group, as torch's.

    **torch.optim's implementation flags** are group options of every group, with torch's defaults, mapped onto
    fadam's backends (``fadam.backend``): ``fused=True`` runs torch's fused kernel where the alias has one (bit for
    bit ``torch.optim``'s ``fused=True``), else fadam's generated kernel ("auto", as when neither flag is set);
    ``foreach=True`` runs fadam's generated kernel, one call over all of a group's leaves, never torch's fused
    kernels ("kernel"); ``foreach=False`` or ``fused=False``, torch's for-loop, runs torch ops per param ("eager").
    ``fused=True`` raises as torch.optim does for a param its fused kernels do not take (not floating point, or on
    another device), with ``foreach=True`` and with ``differentiable=True``; ``foreach=True`` with
    ``differentiable=True`` raises too. ``differentiable=True`` steps under autograd, as torch.optim does: the params
    (non-leaf tensors, which the optimizer then accepts) are written in place from an update computed on the eager
    path without donation, so gradients reach the initial params, the gradients, the state and a tensor ``lr`` or
    hyperparameter. ``capturable=True`` steps the group's transform as ``fadam.capturable`` runs it: its step counts
    on the params' device, a step that reads no device value on the host (a tensor ``lr`` stays a tensor) and writes
    the params and the state in place, so that ``step()`` can be captured in a CUDA graph after a first step outside
    it, as torch.optim's can; CPU params take the same route (torch.optim refuses them, fadam takes them), params on
    other devices than torch's capturable ones are refused. The flags are checked at construction and when they
    change.

    **Sparse gradients** (``nn.Embedding(sparse=True)``'s) step where the group's transform takes them: ``fadam.sgd``
    and ``fadam.adagrad`` without weight decay, ``fadam.sparse_adam`` (``fadam.SparseAdam`` stands for
    ``torch.optim.SparseAdam``); other transforms refuse them, naming the param. ``fused=True`` refuses them, as
    torch.optim's fused implementations do, in their words.

    The functional state of group ``i`` is ``optimizer.tx_states[i]``. ``state_dict`` lays it out as torch.optim
    does, by param position: ``"state"`` maps each param's index to its own leaves, keyed by their path in the state
    without the param's part (``{"state[0].mu": ..., "state[0].nu": ...}``); leaves shared by a group's params (step
    counts, injected hyperparameters) are in ``param_groups[i]["tx_state"]``, next to ``params`` (the indices),
    ``param_names`` and the group's options. The indices are torch.optim's for the same params, named or not: the
    entries as given are counted across groups, and a param listed twice in a group is listed twice in ``params``,
    with one number. Tensors and plain values only (numbers, strings, flags, tuples of them): it loads with
    ``torch.load(weights_only=True)``. ``load_state_dict`` matches params by position, so named and unnamed
    optimizers load each other's state, checks every entry and leaf against a state of the layout the saved options
    give, and loads nothing unless all match; the saved options then replace the groups', as in torch.optim. It also
    takes a torch.optim optimizer's ``state_dict`` (converted as ``fadam.state_from_torch`` does) and the older fadam
    layout (a list of state leaves per group; only into groups with the same param names). Both run torch.optim's
    ``state_dict`` and ``load_state_dict`` hooks, and ``step`` its step hooks. ``torch.amp.GradScaler`` works through
    its standard path (``scaler.unscale_`` then a skipped step when a gradient is not finite).

    ``copy.deepcopy`` gives an independent optimizer: param groups and state are copied as torch.optim's are, through
    the memo (``copy.deepcopy((model, optimizer))`` steps the copied model), factories are rebuilt to read the copied
    groups' options, and transforms are shared. ``pickle`` works when every ``tx`` pickles (a factory such as
    ``fadam.adam`` or a ``functools.partial`` of one); fadam's ready transforms are closures, and ``pickle.dumps``
    refuses them: save ``state_dict()`` and load it into a new ``fadam.Optimizer``.

    Args:
        params: params, named params or param-group dicts (keys ``params``, optional ``tx``, ``lr`` and options).
        tx: a ``GradientTransformation`` or a factory ``tx(lr=..., **options) -> GradientTransformation``.
        lr: the learning rate of groups that do not set one (for a ready transform: the one it was built with;
            for a factory, its default if not given).
        foreach: torch.optim's ``foreach``: ``True`` for fadam's generated kernel, ``False`` for torch ops per param.
        fused: torch.optim's ``fused``: ``True`` for the fused kernels, ``False`` for torch ops per param.
        capturable: torch.optim's ``capturable``: steps that a CUDA graph can capture (``fadam.capturable``).
        differentiable: torch.optim's ``differentiable``: steps that autograd records.
        **options: the factory's other arguments, for the groups that do not set them.

    Example:
        >>> import torch, fadam
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = fadam.Optimizer(model.named_parameters(), fadam.adam, lr=0.1)
        >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> opt.step(); sched.step()
        >>> opt.param_groups[0]["lr"], int(opt.tx_states[0][0].count)
        (0.05, 1)
        >>> sorted(opt.state_dict()["state"][0]), opt.state_dict()["param_groups"][0]["param_names"]
        (['state[0].mu', 'state[0].nu'], ['weight', 'bias'])
    """

    def __init__(
        self,
        params: Iterable[Any],
        tx: TransformOrFactory,
        *,
        lr: float | torch.Tensor | None = None,
        foreach: bool | None = None,
        fused: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        **options: Any,
    ):
        self._txs: list[GradientTransformation] = []
        self._specs: list[TransformOrFactory] = []  # each group's tx as given
        self._modes: list[str] = []
        self._base_lrs: list[float] = []
        self._given: list[_Given] = []
        self._recipes: list[_Recipe | None] = []  # None for a ready transform
        self._built_with: list[dict[str, Any]] = []  # the option values each group's transform was built with
        self._fresh: list[bool] = []  # the group's state is still the one init made: nothing stepped or loaded
        self._flags: list[tuple[Any, ...]] = []  # the flags last checked, for each group
        self._shared_options = options  # given here: defaults for every group whose factory takes them
        self.tx_states: list[PyTree] = []
        flags = {"foreach": foreach, "fused": fused, "capturable": capturable, "differentiable": differentiable}
        super().__init__(params, {"lr": lr, "tx": tx, **_default_options(tx, options), **flags})

    # --- groups -----------------------------------------------------------------------------------------------------

    @staticmethod
    def _tree(group: dict[str, Any], leaves: list[Any]) -> PyTree:
        names = group.get("param_names")
        return dict(zip(names, leaves)) if names is not None else list(leaves)

    def _unique_params(self, entries: Sequence[Any]) -> tuple[list[Any], _Given]:
        """A new group's entries with each param once, warning as torch.optim does when one is listed twice, and how
        they were given; refuses one name for two params and params overlapping any param in memory."""
        index = len(self.param_groups)
        named = [isinstance(e, tuple) for e in entries]
        names = [e[0] for e in entries] if entries and all(named) else None
        labelled = _labelled([e[1] if is_named else e for e, is_named in zip(entries, named)], names)
        first, positions = _first_entries([p for _, p in labelled])
        unique = [entries[i] for i in first]
        if names is not None and len({e[0] for e in unique}) != len(unique):
            raise ValueError(f"param group {index}: param names in a group must be unique, got {names}")
        if len(unique) != len(entries):
            warnings.warn(
                f"param group {index} is a parameter group with duplicate parameters: fadam steps each param once "
                "(torch.optim's for-loop steps it twice, its foreach and fused implementations otherwise)",
                stacklevel=4,
            )
        earlier = [
            (f"param group {i} {label}", p)
            for i, group in enumerate(self.param_groups)
            for label, p in _labelled(group["params"], group.get("param_names"))
        ]
        known = {id(p) for _, p in earlier}  # a param of an earlier group is refused by torch.optim, with its message
        mine = [labelled[i] for i in first]
        _check_no_overlap(
            earlier
            + [
                (f"param group {index} {label}", p)
                for label, p in mine
                if isinstance(p, torch.Tensor) and id(p) not in known
            ]
        )
        return unique, _Given(positions, names)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        params = param_group["params"]
        given = _Given([], None)
        if not isinstance(params, set):  # torch.optim refuses a set
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            param_group["params"], given = self._unique_params(params)
        # a ready transform's lr is given with it: fadam.Optimizer's lr= is not that of a group's own tx
        lr_given = param_group.get("lr", None if "tx" in param_group else self.defaults["lr"]) is not None
        self._own_factory_options(param_group)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        spec = group.pop("tx")
        try:
            _check_flags(group, f"param group {len(self.param_groups) - 1}")
            _check_tensor_options(group, spec)
            tx, mode, state, recipe, values = self._setup(group, spec, lr_given)
            if len(self.param_groups) > 1 and any(_minimizes(t) for t in (*self._txs, tx)):
                raise ValueError("LBFGS doesn't support per-parameter options (parameter groups)")
        except Exception:
            del self.param_groups[-1]
            raise
        self._txs.append(tx)
        self._specs.append(spec)
        self._modes.append(mode)
        self._base_lrs.append(_lr_value(group["lr"]))
        self._given.append(given)
        self._recipes.append(recipe)
        self._built_with.append(values)
        self._fresh.append(True)
        self._flags.append(_flags_of(group))
        self.tx_states.append(state)

    def _own_factory_options(self, param_group: dict[str, Any]) -> None:
        """Fills in the options of a group's own factory that the group does not set: those given to
        ``fadam.Optimizer`` where the factory takes them, else the factory's defaults (torch.optim then adds the
        optimizer's defaults for the other keys, which this group's transform does not read)."""
        spec = param_group.get("tx")
        if spec is None or isinstance(spec, GradientTransformation) or not callable(spec):
            return
        _, defaults = _recipe(spec)
        where = f"param group {len(self.param_groups)}"
        for name, default in defaults.items():
            if name in param_group:
                continue
            value = self._shared_options.get(name, default)
            if value is required:
                raise ValueError(f"{where}: {_factory_name(spec)} needs the option {name!r}")
            param_group[name] = value

    def _setup(
        self, group: dict[str, Any], spec: TransformOrFactory, lr_given: bool
    ) -> tuple[GradientTransformation, str, PyTree, _Recipe | None, dict[str, Any]]:
        """The new ``group``'s transform, mode, initial state, recipe and option values; sets its ``lr`` when the
        transform holds one."""
        params = self._tree(group, [p.detach() for p in group["params"]])
        where = f"param group {len(self.param_groups) - 1}"
        if isinstance(spec, GradientTransformation):
            state = _run_as(spec, group).init(params)
            injected = _injected_lr(state)
            if injected is not None:
                if group["lr"] is None:
                    group["lr"] = _lr_value(injected)
                return spec, "injected", state, None, {}
            if not lr_given:
                raise ValueError(
                    f"{where}: fadam cannot read a ready transform's learning rate: pass the one it was built with as "
                    "lr= (the group's lr for a group's own tx), or a factory (fadam.adam, not fadam.adam(...)) and lr="
                )
            if _lr_value(group["lr"]) == 0.0:
                raise ValueError("lr 0 cannot be the base a ready-made transform is rescaled from; pass a factory")
            return spec, "rescale", state, None, {}
        if callable(spec):
            recipe = _recipe(spec, self._shared_options if spec is self.defaults["tx"] else ())[0]
            if group["lr"] is None:  # the factory's default, as torch.optim's classes have theirs
                group["lr"] = _lr_default(recipe)
            values = _option_values(group, recipe, where)
            tx = _build(recipe, values, group, where)
            # options a default resolves (fadam.lbfgs's max_eval), written into the group as torch.optim does
            for name, value in getattr(tx.update, "resolved", {}).items():
                if values.get(name, value) is None:
                    group[name] = values[name] = value
            return tx, "factory", _run_as(tx, group).init(params), recipe, values
        raise TypeError(f"tx must be a GradientTransformation or a factory taking lr, got {type(spec).__name__}")

    # --- copies ----------------------------------------------------------------------------------------------------

    def _carried(self) -> dict[str, Any]:
        return {**super().__getstate__(), **{key: self.__dict__[key] for key in _CARRIED}}

    def __getstate__(self) -> dict[str, Any]:
        """What pickle saves; refuses, naming it, a transform that does not pickle (fadam's are closures)."""
        specs = [("tx", self.defaults["tx"])] + [(f"param group {i}'s tx", s) for i, s in enumerate(self._specs)]
        for where, spec in specs:
            try:
                pickle.dumps(spec)
            except (pickle.PicklingError, AttributeError, TypeError) as error:
                raise pickle.PicklingError(
                    f"cannot pickle this fadam.Optimizer: its {where} does not pickle ({error}); save its "
                    "state_dict() and load that into a new fadam.Optimizer, or give a factory such as fadam.adam"
                ) from None
        return self._carried()

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._txs = [
            spec if recipe is None else _build(recipe, values, group, f"param group {index}")
            for index, (spec, recipe, values, group) in enumerate(
                zip(self._specs, self._recipes, self._built_with, self.param_groups)
            )
        ]

    def __deepcopy__(self, memo: dict[int, Any]) -> Optimizer:
        """An independent optimizer: its own param groups and state, copied through ``memo`` as torch.optim's are
        (``copy.deepcopy((model, optimizer))`` steps the copied model); the transforms, pure functions, are shared.
        Hooks are not copied, as by torch.optim."""
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin
        for spec in (self.defaults["tx"], *self._specs):
            memo[id(spec)] = spec
        twin.__setstate__(copy.deepcopy(self._carried(), memo))
        return twin

    # --- stepping ---------------------------------------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Performs one optimization step on every group (a group where no param has a gradient is left alone).

        Every group's options are read first, and a group whose options changed gets its transform rebuilt; a bad
        value raises before any group is stepped."""
        self._check_train_mode()
        minimizing = any(_minimizes(tx) for tx in self._txs)
        if minimizing and closure is None:
            raise TypeError(
                "step() missing 1 required positional argument: 'closure' (fadam.lbfgs evaluates the loss closure, "
                "as torch.optim.LBFGS does)"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            prepared = [
                (index, *self._prepared(index))
                for index, group in enumerate(self.param_groups)
                if minimizing or any(p.grad is not None for p in group["params"])
            ]
        for index, tx, state, values in prepared:
            group = self.param_groups[index]
            self._txs[index], self.tx_states[index], self._built_with[index] = tx, state, values
            self._flags[index] = _flags_of(group)
            with torch.set_grad_enabled(group["differentiable"]), backend(_backend_of(group)):
                if _minimizes(tx):
                    self.tx_states[index] = self._minimized(index, tx, state, loss, closure)  # type: ignore[arg-type]
                else:
                    self.tx_states[index] = self._stepped(index, tx, state)
            self._fresh[index] = False
        return loss

    def _prepared(self, index: int) -> tuple[GradientTransformation, PyTree, dict[str, Any]]:
        """Group ``index``'s transform for its current options, its state for that transform, and the option values;
        checks the flags where they changed, and the gradients for them. Changes nothing."""
        group, where = self.param_groups[index], f"param group {index}"
        if _flags_of(group) != self._flags[index]:
            _check_flags(group, where)
        _check_fused_sparse(group, self._specs[index], where)
        recipe, built_with = self._recipes[index], self._built_with[index]
        if recipe is None:
            return self._txs[index], self.tx_states[index], built_with
        values = _option_values(group, recipe, where)
        if all(_same(values[name], built_with[name]) for name in recipe.names):
            return self._txs[index], self.tx_states[index], built_with
        tx = _build(recipe, values, group, where)
        state = self._state_for(index, tx, values)
        return tx, _with_injected(state, values), values

    def _state_for(self, index: int, tx: GradientTransformation, values: dict[str, Any]) -> PyTree:
        """Group ``index``'s state for ``tx``, rebuilt from new option ``values``: the state as it is where the values
        are of the kinds the transform was built with (the same layout), else, once checked, its leaves laid out as
        ``tx``'s (a chain gaining or losing a stateless member); a group that has not stepped takes ``tx``'s fresh
        state. Raises if the state would need another layout."""
        state, built_with = self.tx_states[index], self._built_with[index]
        if all(_kind(values[name]) == _kind(built_with[name]) for name in values):
            return state
        group = self.param_groups[index]
        tree = self._tree(group, [p.detach() for p in group["params"]])
        fresh = _run_as(tx, group).init(tree)
        if self._fresh[index]:
            return fresh
        params_spec = tree_flatten(tree)[1]
        (old, _), (new, new_spec) = tree_flatten(state), tree_flatten(fresh)
        if _leaf_layout(old, _slots(state, params_spec)) != _leaf_layout(new, _slots(fresh, params_spec)):
            changed = ", ".join(
                f"{name}={values[name]!r}" for name in values if not _same(values[name], built_with[name])
            )
            raise ValueError(
                f"param group {index}: {changed} needs an optimizer state of another layout than the one this group "
                "has stepped with; set it before the first step, or in a new fadam.Optimizer"
            )
        return new_spec.unflatten(old)

    def _stepped(self, index: int, tx: GradientTransformation, state: PyTree) -> PyTree:
        """Steps group ``index``'s params in place; returns the new state."""
        group = self.param_groups[index]
        grads = self._tree(group, [p.grad for p in group["params"]])
        if group["differentiable"]:
            return self._stepped_differentiably(index, tx, state, grads)
        # detached views share storage with the params but are plain tensors: fused kernels and in-place writes
        params = self._tree(group, [p.detach() for p in group["params"]])
        mode, tx = self._modes[index], _run_as(tx, group)
        lr = _lr_value(group["lr"]) if mode != "factory" else None  # a factory's transform reads the group's lr
        if mode == "injected":
            state = _with_injected_lr(state, lr)
        if mode == "rescale" and lr != self._base_lrs[index]:
            updates, state = tx.update(grads, state, params)
            factor = lr / self._base_lrs[index]
            for p, u in zip(tree_leaves(params), tree_leaves(updates)):
                if u is not None:
                    p.add_(u.to(p.dtype), alpha=factor)
            return state
        new_params, new_state = step(tx, params, grads, state, donate=True)
        for p, new in zip(tree_leaves(params), tree_leaves(new_params)):
            if new is not p:
                p.copy_(new)
        # a capturable group's state stays in its tensors on every backend (fadam.backend("eager"), foreach=False,
        # runs the update and returns a new state): a captured step() then replays into the same storage
        return _write_into(state, new_state) if group["capturable"] else new_state

    def _minimized(
        self, index: int, tx: GradientTransformation, state: PyTree, loss: Any, closure: Callable[[], Any]
    ) -> PyTree:
        """Steps group ``index`` by a transform that minimizes the closure's loss (``fadam.lbfgs``), as
        ``torch.optim.LBFGS.step`` does: the closure runs at each point the transform evaluates, with the params set
        to it, and the params end at the point the transform computed, bit for bit."""
        group = self.param_groups[index]
        if group["differentiable"]:
            raise ValueError(f"param group {index}: fadam.lbfgs does not step differentiably (differentiable=True)")
        if self._modes[index] == "rescale" and _lr_value(group["lr"]) != self._base_lrs[index]:
            raise ValueError(
                f"param group {index}: a ready fadam.lbfgs transform keeps the lr it was built with; pass the factory "
                "fadam.lbfgs to follow the group's lr"
            )
        live = list(group["params"])
        targets = tree_leaves(self._tree(group, live))

        def value_fn(point: PyTree) -> tuple[Any, PyTree]:
            with torch.no_grad():
                for p, x in zip(targets, tree_leaves(point)):
                    p.copy_(x)
            return closure(), self._tree(group, [p.grad for p in live])

        # copies: the transform reads the starting point while value_fn writes the params
        params = self._tree(group, [p.detach().clone() for p in live])
        grads = self._tree(group, [p.grad for p in live])
        new_params, state = tx.update.minimize(grads, state, params, value=loss, value_fn=value_fn)  # type: ignore
        for p, new in zip(targets, tree_leaves(new_params)):
            p.copy_(new)
        return state

    def _stepped_differentiably(self, index: int, tx: GradientTransformation, state: PyTree, grads: PyTree) -> PyTree:
        """A step that autograd records, as torch.optim's ``differentiable=True``: the params (non-leaf tensors, or
        ones that do not require grad) are written in place, their new values computed from clones (autograd keeps
        what the step reads) without donation, so the new state holds tensors in the graph too."""
        group = self.param_groups[index]
        params = self._tree(group, [p.clone() for p in group["params"]])
        mode, lr = self._modes[index], group["lr"]
        if mode == "injected":
            state = _with_injected_lr(state, lr)
        updates, state = tx.update(grads, state, params)
        if mode == "rescale" and _lr_value(lr) != self._base_lrs[index]:
            updates = optree.tree_map(
                lambda u: None if u is None else u * (lr / self._base_lrs[index]), updates, none_is_leaf=True
            )
        for p, u in zip(tree_leaves(self._tree(group, list(group["params"]))), tree_leaves(updates)):
            if p.grad is not None and u is not None:
                p.add_(u.to(p.dtype))
        return state

    # --- schedule-free train and eval modes -------------------------------------------------------------------------

    def eval(self) -> None:
        """Sets every param to the evaluation point ``x`` of its schedule-free transform, as ``schedulefree``'s
        optimizers' ``eval()`` does (``fadam.schedule_free_eval_params``); ``train()`` sets them back to the train
        point ``y``. The mode is each group's ``"train_mode"`` (absent: train, where a group starts), kept in
        ``state_dict``: save checkpoints in eval mode, as schedulefree advises. ``step`` refuses to run in eval mode.
        Raises ``TypeError``, changing nothing, unless every group's transform is schedule-free."""
        self._switch_mode(train=False)

    def train(self) -> None:
        """Sets the params back to the train point ``y`` after ``eval()`` (a no-op in train mode)."""
        self._switch_mode(train=True)

    def _switch_mode(self, train: bool) -> None:
        for index, state in enumerate(self.tx_states):
            if not is_schedule_free(state):
                raise TypeError(
                    f"train() and eval() switch the params of schedule-free transforms (fadam.schedule_free_adamw, "
                    f"fadam.schedule_free_sgd, fadam.schedule_free): param group {index}'s transform is not one"
                )
        move = schedule_free_train_params if train else schedule_free_eval_params
        with torch.no_grad():
            for index, group in enumerate(self.param_groups):
                if group.get("train_mode", True) == train:
                    continue
                params = self._tree(group, [p.detach() for p in group["params"]])
                moved = move(self.tx_states[index], params)
                for p, new in zip(optree.tree_leaves(params), optree.tree_leaves(moved)):  # one namespace for both
                    if new is not p:
                        p.copy_(new)
                group["train_mode"] = train

    def _check_train_mode(self) -> None:
        evaluating = [index for index, group in enumerate(self.param_groups) if not group.get("train_mode", True)]
        if evaluating:
            raise RuntimeError(f"param groups {evaluating} are in eval mode (eval()): call train() before step()")

    # --- checkpoints ------------------------------------------------------------------------------------------------

    def _layout(self, index: int, state: PyTree) -> tuple[list[_Slot], list[int]]:
        """The slots of ``state``, group ``index``'s, and for each leaf of its params tree the param's position in
        the group."""
        group = self.param_groups[index]
        tree = self._tree(group, list(group["params"]))
        return _slots(state, tree_flatten(tree)[1]), _given_order(tree)

    def _param_label(self, index: int, position: int) -> str:
        names = self.param_groups[index].get("param_names")
        return f"param group {index}, param {path_str((names[position] if names is not None else position,))}"

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """``{"state": {param index: {state path: tensor}}, "param_groups": [...]}`` (see the class docstring).

        Runs the hooks of ``register_state_dict_pre_hook`` (``hook(optimizer)``) before and of
        ``register_state_dict_post_hook`` (``hook(optimizer, state_dict)``, which may return a replacement) after, as
        torch.optim does."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state_dict = self._packed()
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            replaced = post_hook(self, state_dict)
            if replaced is not None:
                state_dict = replaced
        return state_dict

    def _numbering(self) -> list[list[int]]:
        """Each group's ``params`` in ``state_dict``, numbered as torch.optim numbers the params as given: the
        entries are counted across groups, and each param takes the number of its last entry in its group."""
        numbers: dict[int, int] = {}  # id of a param -> its number
        numbering, start = [], 0
        for group, given in zip(self.param_groups, self._given):
            listed = [group["params"][position] for position in given.positions]
            numbers.update({id(p): i for i, p in enumerate(listed, start) if id(p) not in numbers})
            numbering.append([numbers[id(p)] for p in listed])
            start += len(listed)
        return numbering

    def _packed(self) -> dict[str, Any]:
        state: dict[int, dict[str, Any]] = {}
        groups = []
        for index, (group, numbers) in enumerate(zip(self.param_groups, self._numbering())):
            slots, positions = self._layout(index, self.tx_states[index])
            keys = _per_distinct(self._given[index], numbers)
            shared: dict[str, Any] = {}
            for leaf, slot in zip(tree_leaves(self.tx_states[index]), slots):
                if leaf is None:
                    continue
                if slot.param is None:
                    shared[slot.key] = leaf
                else:
                    state.setdefault(keys[positions[slot.param]], {})[slot.key] = leaf
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = numbers
            if self._given[index].names is not None:
                packed["param_names"] = list(self._given[index].names)
            packed["tx_state"] = shared
            groups.append(packed)
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Loads a ``state_dict`` of a ``fadam.Optimizer`` or a torch.optim optimizer (see the class docstring);
        raises naming the first mismatch and then loads nothing.

        As torch.optim does, the hooks of ``register_load_state_dict_pre_hook`` get a shallow copy of ``state_dict``
        (``hook(optimizer, state_dict)``, which may return a replacement to load) and those of
        ``register_load_state_dict_post_hook`` run once it is loaded (``hook(optimizer)``)."""
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            replaced = pre_hook(self, state_dict)
            if replaced is not None:
                state_dict = replaced
        self._load(state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _load(self, state_dict: dict[str, Any]) -> None:
        saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"state_dict has {len(saved_groups)} param groups, this optimizer {len(self.param_groups)}"
            )
        for index, (given, saved) in enumerate(zip(self._given, saved_groups)):
            if len(saved["params"]) != len(given.positions):
                raise ValueError(
                    f"param group {index}: state_dict has {len(saved['params'])} params, "
                    f"this optimizer {len(given.positions)}"
                )
        if any(isinstance(entry, list) for entry in saved_state.values()):
            load = self._load_leaves
        elif all("tx_state" in saved for saved in saved_groups):
            load = self._load_entries
        else:
            load = self._load_torch
        targets = [self._loading_target(index, saved) for index, saved in enumerate(saved_groups)]
        new_states = [
            load(index, saved, saved_state, tx, template)
            for index, (saved, (tx, template, _)) in enumerate(zip(saved_groups, targets))
        ]
        for index, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            group.update(_saved_options(saved))
            self._txs[index], _, self._built_with[index] = targets[index]
            self.tx_states[index] = new_states[index]
            self._fresh[index] = False
            self._flags[index] = _flags_of(group)

    def _loading_target(
        self, index: int, saved: dict[str, Any]
    ) -> tuple[GradientTransformation, PyTree, dict[str, Any]]:
        """Group ``index``'s transform for the options ``saved`` holds (torch.optim loads them with the state), a
        state of that transform's layout to check the saved one against, and the option values. Changes nothing."""
        group, where = self.param_groups[index], f"param group {index}"
        loaded = {**group, **_saved_options(saved)}
        _check_flags(loaded, where)
        recipe, built_with = self._recipes[index], self._built_with[index]
        if recipe is None:
            return self._txs[index], self.tx_states[index], built_with
        values = _option_values(loaded, recipe, where)
        if all(_same(values[name], built_with[name]) for name in recipe.names):
            return self._txs[index], self.tx_states[index], built_with
        tx = _build(recipe, values, group, where)
        if all(_kind(values[name]) == _kind(built_with[name]) for name in values):
            return tx, self.tx_states[index], values
        return tx, _run_as(tx, loaded).init(self._tree(group, [p.detach() for p in group["params"]])), values

    def _load_entries(
        self, index: int, saved: dict[str, Any], saved_state: dict[int, Any], tx: GradientTransformation, template: Any
    ) -> PyTree:
        """Group ``index``'s state from this class's ``state_dict`` layout, checked entry by entry and leaf by leaf
        against ``template``, a state of the group's transform."""
        slots, positions = self._layout(index, template)
        current, spec = tree_flatten(template)
        entries = [saved_state.get(i, {}) for i in _per_distinct(self._given[index], saved["params"])]
        expected: list[set[str]] = [set() for _ in positions]
        for leaf, slot in zip(current, slots):
            if leaf is not None and slot.param is not None:
                expected[positions[slot.param]].add(slot.key)
        for position, keys in enumerate(expected):
            if set(entries[position]) != keys:
                raise ValueError(
                    f"{self._param_label(index, position)}: state_dict holds {sorted(entries[position])}, "
                    f"expected {sorted(keys)}"
                )
        shared = {slot.key for leaf, slot in zip(current, slots) if leaf is not None and slot.param is None}
        if set(saved["tx_state"]) != shared:
            raise ValueError(
                f"param group {index}: state_dict holds shared state {sorted(saved['tx_state'])}, "
                f"expected {sorted(shared)}"
            )
        loaded = []
        for old, slot in zip(current, slots):
            if old is None:
                loaded.append(None)
            elif slot.param is None:
                loaded.append(_checked(f"param group {index}, {slot.key}", saved["tx_state"][slot.key], old))
            else:
                position = positions[slot.param]
                where = f"{self._param_label(index, position)}, {slot.key}"
                loaded.append(_checked(where, entries[position][slot.key], old))
        return spec.unflatten(loaded)

    def _load_leaves(
        self, index: int, saved: dict[str, Any], saved_state: dict[int, Any], tx: GradientTransformation, template: Any
    ) -> PyTree:
        """Group ``index``'s state from fadam's older layout: the group's state leaves in the order optree flattens
        them, which depends on the param names (sorted), so the names must be the same."""
        if saved.get("param_names") != self.param_groups[index].get("param_names"):
            raise ValueError(
                f"param group {index}: this state_dict has fadam's older layout (state leaves per group, in the "
                "order of the params tree), which loads only into a group with the same param names"
            )
        current, spec = tree_flatten(template)
        leaves = saved_state[index]
        if len(leaves) != len(current):
            raise ValueError(f"param group {index}: state_dict has {len(leaves)} state leaves, expected {len(current)}")
        accessors = optree.tree_accessors(template, none_is_leaf=True)
        where = [f"param group {index}, state leaf {accessor.codify('state')}" for accessor in accessors]
        return spec.unflatten([_checked(w, new, old) for w, new, old in zip(where, leaves, current)])

    def _load_torch(
        self, index: int, saved: dict[str, Any], saved_state: dict[int, Any], tx: GradientTransformation, template: Any
    ) -> PyTree:
        """Group ``index``'s state converted from a torch.optim ``state_dict``, its params matched by position."""
        group = self.param_groups[index]
        params = self._tree(group, [p.detach() for p in group["params"]])
        by_position = [saved_state.get(i, {}) for i in _per_distinct(self._given[index], saved["params"])]
        try:
            return _convert_from_torch([by_position[i] for i in _given_order(params)], _run_as(tx, group), params, None)
        except ValueError as error:
            raise ValueError(f"param group {index}: a torch.optim state_dict that does not convert: {error}") from None


class SparseAdam(Optimizer):
    r"""``torch.optim.SparseAdam`` as a ``fadam.Optimizer`` over ``fadam.sparse_adam``: its constructor, its checks with
    its messages (sparse and complex params are refused, as are dense gradients at the step), and its numbers: Adam
    at the elements each sparse gradient stores, for the gradients of ``nn.Embedding(sparse=True)``.

    Args:
        params: params, named params or param-group dicts, as ``fadam.Optimizer`` takes them.
        lr: the learning rate, above 0.
        betas: the decays of the first and second moments, in [0, 1).
        eps: added to the root of the second moment, above 0.
        maximize: maximize the objective.

    Example:
        >>> import torch, fadam
        >>> emb = torch.nn.Embedding(3, 2, sparse=True)
        >>> opt = fadam.SparseAdam(emb.parameters(), lr=0.1)
        >>> before = emb.weight.detach().clone()
        >>> emb(torch.tensor([0, 2, 0])).sum().backward()
        >>> opt.step()
        >>> (emb.weight.detach() - before).abs().amax(dim=1)  # row 1 had no gradient
        tensor([0.1000, 0.0000, 0.1000])
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        maximize: bool = False,
    ) -> None:
        check_sparse_adam_args(lr, betas, eps)
        super().__init__(params, sparse_adam, lr=lr, betas=betas, eps=eps, maximize=maximize)
        indexed = [([i, j], p) for i, group in enumerate(self.param_groups) for j, p in enumerate(group["params"])]
        sparse = [index for index, p in indexed if p.is_sparse]
        if sparse:
            raise ValueError(f"Sparse params at indices {sparse}: SparseAdam requires dense parameter tensors")
        complex_params = [index for index, p in indexed if p.is_complex()]
        if complex_params:
            raise ValueError(
                f"Complex params at indices {complex_params}: SparseAdam does not support complex parameters"
            )


# --- torch.optim state import / export ------------------------------------------------------------------------------

# (fadam state type, field shaped like the params) -> torch.optim's per-param state key
_MOMENTS: dict[tuple[type, str], str] = {
    (ScaleByAdamState, "mu"): "exp_avg",
    (ScaleByAdamState, "nu"): "exp_avg_sq",
    (ScaleByAmsgradState, "mu"): "exp_avg",
    (ScaleByAmsgradState, "nu"): "exp_avg_sq",
    (ScaleByAmsgradState, "nu_max"): "max_exp_avg_sq",
    (ScaleByNadamState, "mu"): "exp_avg",
    (ScaleByNadamState, "nu"): "exp_avg_sq",
    (ScaleByRadamState, "mu"): "exp_avg",
    (ScaleByRadamState, "nu"): "exp_avg_sq",
    (ScaleByAdamaxState, "mu"): "exp_avg",
    (ScaleByAdamaxState, "nu"): "exp_inf",
    (ScaleByRmsState, "nu"): "square_avg",
    (ScaleByRStdDevState, "mu"): "grad_avg",
    (ScaleByRStdDevState, "nu"): "square_avg",
    (ScaleByRssState, "sum_of_squares"): "sum",
    (TraceState, "trace"): "momentum_buffer",
    (ScaleByAdadeltaState, "square_avg"): "square_avg",
    (ScaleByAdadeltaState, "acc_delta"): "acc_delta",
    (ScaleByAsgdState, "ax"): "ax",
    (ScaleByRpropState, "prev"): "prev",
    (ScaleByRpropState, "step_size"): "step_size",
    (ScaleByAdafactorTorchState, "row_var"): "row_var",
    (ScaleByAdafactorTorchState, "col_var"): "col_var",
    (ScaleByAdafactorTorchState, "variance"): "variance",
    (ScaleByMuonState, "mu"): "momentum_buffer",
}
# fields whose entry for a param of that many dims is a placeholder, not state torch.optim keeps (Adafactor keeps
# row and column statistics of matrices, a full second moment of the others)
_PLACEHOLDERS: dict[tuple[type, str], Callable[[int], bool]] = {
    (ScaleByAdafactorTorchState, "row_var"): lambda ndim: ndim < 2,
    (ScaleByAdafactorTorchState, "col_var"): lambda ndim: ndim < 2,
    (ScaleByAdafactorTorchState, "variance"): lambda ndim: ndim >= 2,
}


def _asgd_rates(group: dict[str, Any], param: torch.Tensor, count: int) -> dict[str, torch.Tensor]:
    """torch.optim.ASGD's ``eta`` and ``mu`` after ``count`` steps of ``group``: fadam derives them from the count."""
    dtype = _scalar_dtype()
    lr = _lr_value(group["lr"])
    eta, mu = _rates(lr, group["lambd"], group["alpha"], group["t0"], torch.tensor(count), dtype)
    return {name: torch.tensor(value, dtype=dtype, device=param.device) for name, value in (("eta", eta), ("mu", mu))}


# torch.optim keys that fadam derives from the step count and the hyperparameters instead of keeping: read as present
# (and ignored) on import, computed from the optimizer's group on export
_DERIVED: dict[type, tuple[tuple[str, ...], Callable[[dict[str, Any], torch.Tensor, int], dict[str, torch.Tensor]]]] = {
    ScaleByAsgdState: (("eta", "mu"), _asgd_rates)
}
# scalar fields kept once in fadam and per param in torch.optim
_SCALARS: dict[tuple[type, str], str] = {(ScaleByNadamState, "mu_product"): "mu_product"}
# the fadam states whose torch.optim optimizer keeps a per-param ``step`` (all but SGD's momentum)
_STEPPED = frozenset(owner for owner, _ in _MOMENTS) - {TraceState, ScaleByMuonState}
# torch.optim optimizer -> the per-param keys it keeps once stepped, and those a group option adds
_TORCH_KEYS: tuple[tuple[type[torch.optim.Optimizer], frozenset[str], dict[str, str]], ...] = (
    (torch.optim.SGD, frozenset(), {"momentum": "momentum_buffer"}),
    (torch.optim.Adam, frozenset({"step", "exp_avg", "exp_avg_sq"}), {"amsgrad": "max_exp_avg_sq"}),  # and AdamW
    (torch.optim.NAdam, frozenset({"step", "mu_product", "exp_avg", "exp_avg_sq"}), {}),
    (torch.optim.RAdam, frozenset({"step", "exp_avg", "exp_avg_sq"}), {}),
    (torch.optim.Adamax, frozenset({"step", "exp_avg", "exp_inf"}), {}),
    (torch.optim.RMSprop, frozenset({"step", "square_avg"}), {"momentum": "momentum_buffer", "centered": "grad_avg"}),
    (torch.optim.Adagrad, frozenset({"step", "sum"}), {}),
    (torch.optim.Adadelta, frozenset({"step", "square_avg", "acc_delta"}), {}),
    (torch.optim.ASGD, frozenset({"step", "eta", "mu", "ax"}), {}),
    (torch.optim.Rprop, frozenset({"step", "prev", "step_size"}), {}),
    (torch.optim.Adafactor, frozenset({"step"}), {}),  # and its statistics, by the param's dims
    (torch.optim.Muon, frozenset({"momentum_buffer"}), {}),
    (torch.optim.SparseAdam, frozenset({"step", "exp_avg", "exp_avg_sq"}), {}),
)


def _param_leaves(params: PyTree) -> tuple[list[Any], optree.PyTreeSpec]:
    leaves, spec = tree_flatten(params)
    if spec.is_leaf():
        raise ValueError("params must be a container of tensors (a list, a dict), not a single tensor: pass [param]")
    return leaves, spec


def _torch_entries(
    leaves: list[Any], slots: list[_Slot], paths: list[str], ndims: list[int]
) -> tuple[list[dict[str, int]], list[bool], list[set[type]]]:
    """For each param (of ``ndims`` dims): the torch.optim keys its fadam state maps to (key -> index of the state
    leaf holding it), whether torch.optim keeps a ``step`` for it, and the fadam state types holding its state. Raises
    for a param's state that has no torch.optim counterpart."""
    entries: list[dict[str, int]] = [{} for _ in paths]
    owners: list[set[type]] = [set() for _ in paths]
    for index, (leaf, slot) in enumerate(zip(leaves, slots)):
        if slot.param is None or leaf is None:
            continue
        placeholder = _PLACEHOLDERS.get((slot.owner, slot.field))  # type: ignore[arg-type]
        if placeholder is not None and placeholder(ndims[slot.param]):
            continue
        key = _MOMENTS.get((slot.owner, slot.field))  # type: ignore[arg-type]
        where = f"param {paths[slot.param]}: fadam's {slot.key}"
        field = f"{slot.owner.__name__}.{slot.field}" if slot.owner is not None else "a container"
        if key is None:
            raise ValueError(f"{where} ({field}) has no torch.optim counterpart")
        if not slot.whole:
            raise ValueError(f"{where} is part of a quantized {field}; only full-precision state converts")
        entries[slot.param][key] = index
        owners[slot.param].add(slot.owner)  # type: ignore[arg-type]
    for index, slot in enumerate(slots):
        key = _SCALARS.get((slot.owner, slot.field)) if slot.param is None else None  # type: ignore[arg-type]
        for param, types in enumerate(owners):
            if key is not None and slot.owner in types:
                entries[param][key] = index
    return entries, [bool(types & _STEPPED) for types in owners], owners


def _derived_keys(types: set[type]) -> set[str]:
    return {key for owner in types if owner in _DERIVED for key in _DERIVED[owner][0]}


def _torch_param_states(source: torch.optim.Optimizer | dict[str, Any], params: PyTree) -> list[dict[str, Any]]:
    """torch.optim's per-param state for each leaf of ``params``: matched by identity to an optimizer's params, by
    name when the optimizer was given named params and ``params`` is a dict of them, by order otherwise (dicts in
    insertion order)."""
    leaves, spec = tree_flatten(params)
    if isinstance(source, Optimizer):
        raise TypeError("a fadam.Optimizer keeps its state in tx_states; state_from_torch reads torch.optim's")
    if isinstance(source, torch.optim.Optimizer):
        opt_params = [p for g in source.param_groups for p in g["params"]]
        by_id = {id(p): p for p in opt_params}
        if all(id(p) in by_id for p in leaves):
            return [source.state.get(p, {}) for p in leaves]
        source = source.state_dict()
    if any("tx_state" in g for g in source["param_groups"]):
        raise ValueError("this is a fadam.Optimizer state_dict: load it with fadam.Optimizer.load_state_dict")
    indices = [i for g in source["param_groups"] for i in g["params"]]
    names = [n for g in source["param_groups"] for n in g.get("param_names", ())]
    keys = [path[0] if len(path) == 1 else None for path in spec.paths()]
    if len(names) == len(indices) and all(k in names for k in keys):
        by_name = dict(zip(names, indices))
        return [source["state"].get(by_name[k], {}) for k in keys]
    if len(indices) != len(leaves):
        raise ValueError(f"the torch optimizer has {len(indices)} params but params has {len(leaves)} leaves")
    return [source["state"].get(indices[i], {}) for i in _given_order(params)]


def _common_step(per_param: list[dict[str, Any]], paths: list[str]) -> int | None:
    """torch.optim's per-param step, which must be the same for every param: fadam keeps one count."""
    steps = {path: int(float(s["step"])) if "step" in s else 0 for path, s in zip(paths, per_param)}
    if not any("step" in s for s in per_param):
        return None
    if len(set(steps.values())) > 1:
        detail = ", ".join(f"{path}: {n}" for path, n in list(steps.items())[:6])
        raise ValueError(
            "torch.optim's per-param steps differ (" + detail + "); fadam keeps one step count for all params and "
            "would use wrong bias corrections for some of them, so it refuses to convert this state"
        )
    return next(iter(steps.values()))


def _torch_value(value: Any, old: torch.Tensor, where: str) -> torch.Tensor:
    value = torch.as_tensor(value)
    if value.is_sparse:  # SGD's momentum buffer of sparse gradients: fadam's is dense, with the same values
        value = value.to_dense()
    if value.shape != old.shape:
        raise ValueError(f"{where} has shape {tuple(value.shape)}, expected {tuple(old.shape)}")
    return value.detach().to(dtype=old.dtype, device=old.device, copy=True)


def _convert_from_torch(
    per_param: list[dict[str, Any]], tx: GradientTransformation, params: PyTree, count: int | None
) -> PyTree:
    """``tx``'s state for ``params`` holding ``per_param`` (torch.optim's state of each params leaf, in order)."""
    param_leaves, spec = tree_flatten(params)
    paths = [path_str(p) for p in spec.paths()]
    state = _unpaged(tx.init(params))
    if isinstance(state, LbfgsState):
        return lbfgs_from_torch(per_param, state, params, count)
    per_param = as_torch_adam(per_param, param_leaves, paths)  # bitsandbytes' state as torch.optim.Adam's
    state, quantized = full_precision(tx, state)
    leaves, state_spec = tree_flatten(state)
    slots = _slots(state, spec)
    found = [{key for key, value in s.items() if value is not None} for s in per_param]
    new_leaves = list(leaves)
    stepped = any(found)  # torch.optim's state is empty until a param's first step: that converts to a fresh state
    if stepped:
        ndims = [p.dim() for p in param_leaves]
        entries, keeps_step, owners = _torch_entries(leaves, slots, paths, ndims)
        for path, keys, has_step, got, types in zip(paths, entries, keeps_step, found, owners):
            expected = set(keys) | ({"step"} if has_step else set()) | _derived_keys(types)
            if got != expected:
                raise ValueError(
                    f"cannot convert torch.optim state of param {path}: expected keys {sorted(expected)}, "
                    f"found {sorted(got)}"
                )
        for param, keys in enumerate(entries):
            for key, index in keys.items():
                where = f"torch state {key!r} of {paths[param]}"
                new_leaves[index] = _torch_value(per_param[param][key], leaves[index], where)
    if count is None:
        count = _common_step(per_param, paths)
    if count is None:
        count = 1 if stepped else 0  # SGD keeps no step: a momentum buffer exists from the first step on
    for index, (leaf, slot) in enumerate(zip(leaves, slots)):
        if slot.param is None and slot.field == "count" and leaf is not None:
            new_leaves[index] = torch.tensor(count, dtype=leaf.dtype, device=leaf.device)
    return quantized(state_spec.unflatten(new_leaves))


def _unpaged(state: PyTree) -> PyTree:
    """``state``, refused if it is paged (``fadam.page_state``): its values live in its storage, not in its leaves."""
    nodes = optree.tree_leaves(state, is_leaf=lambda node: isinstance(node, PagedState), none_is_leaf=True)
    if any(isinstance(node, PagedState) for node in nodes):
        raise ValueError(
            "a paged state (fadam.page_state, fadam.paged_*) keeps its values in its storage and does not convert: "
            "convert the state of the unpaged transform (fadam.adamw8bit for fadam.paged_adamw8bit)"
        )
    return state


def state_from_torch(
    source: torch.optim.Optimizer | dict[str, Any],
    tx: GradientTransformation,
    params: PyTree,
    *,
    count: int | None = None,
) -> PyTree:
    r"""Converts a torch.optim optimizer's state into the functional state of ``tx``, to continue a run with fadam.

    Supported: the moments of ``Adam``/``AdamW`` (and AMSGrad), ``SGD``'s momentum buffer, and those of ``NAdam``,
    ``RAdam``, ``Adamax``, ``RMSprop``, ``Adagrad``, ``Adadelta``, ``ASGD`` (its ``ax``; ``eta`` and ``mu`` follow
    from the step), ``Rprop``, ``Adafactor`` (row and column statistics of matrices, the full moment of the other
    params), ``Muon`` and ``SparseAdam``, mapped onto the matching fadam states inside ``tx``'s state (a sparse
    momentum buffer, which ``SGD`` keeps for sparse gradients, densified); every step count in the state becomes
    torch's step. torch.optim keeps one step per param and fadam one per transform:
    if the params' steps differ the conversion is refused. ``SGD`` keeps no step: its count is taken as 1 once a
    momentum buffer exists (pass ``count`` to set it, e.g. for a learning-rate schedule). Hyperparameters are not
    read: build ``tx`` with the same ones.

    ``LBFGS`` keeps its whole state in its first param's dict: it becomes ``fadam.lbfgs``'s ``LbfgsState`` (its
    counts, direction, step length, pairs, ``H_diag``, previous gradient and loss; see ``fadam._lbfgs_state``), so a
    run continues bit for bit; the params must be given in the optimizer's order, and it keeps no step count (taken
    as 1 once it has stepped). bitsandbytes' Adam family (``Adam8bit``, ``AdamW8bit``, ``PagedAdam8bit``,
    ``PagedAdamW8bit``, ``Adam``, ``AdamW``; an optimizer or its ``state_dict``, recognised by its keys) converts as
    torch.optim.Adam's state: its 8-bit moments are dequantized with its maps and scales (``fadam._bitsandbytes_state``)
    and its float32 ones taken as they are. Its Adam decays weights decoupled: continue with ``fadam.adamw8bit`` (or
    ``fadam.adamw``) and its ``weight_decay``. Moments that ``tx`` keeps quantized (``fadam.adam8bit``, any declared
    transform in ``fadam.quantize_state``) are quantized with fadam's codec as ``tx`` keeps them, so they hold the
    source's values up to half a step of fadam's map times the block's scale.

    Every param's torch state must hold exactly the keys ``tx``'s state maps to (``step``, ``exp_avg`` and
    ``exp_avg_sq`` for ``fadam.adam``; ``momentum_buffer`` for ``fadam.sgd`` with momentum, nothing without), or the
    conversion is refused naming the param and both sets of keys: another optimizer's state, or bitsandbytes' Lion,
    LAMB or AdEMAMix. So is ``tx`` state that has no torch.optim counterpart (Lion's, an EMA), quantized state of an
    opaque transform, and a paged state (``fadam.page_state``, whose values live in its storage: convert into the
    unpaged transform's state). A torch optimizer that has not stepped yet holds no state: that converts to
    ``tx.init(params)``.

    Args:
        source: a torch.optim optimizer (or one of bitsandbytes' Adam family) or its ``state_dict()``.
        tx: the fadam transform that continues the run.
        params: the params, as the pytree ``tx`` sees (a list or dict, dicts in insertion order), in the optimizer's
            order (matched by identity when they are the optimizer's own tensors, by name when ``source`` is a
            ``state_dict`` with ``param_names`` and ``params`` a dict of those names).
        count: overrides the step count.

    Example:
        >>> import torch, fadam
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> opt = torch.optim.Adam([w], lr=0.1)
        >>> w.grad = torch.ones(2); opt.step()
        >>> state = fadam.state_from_torch(opt, fadam.adam(lr=0.1), [w])
        >>> int(state[0].count), state[0].mu[0]
        (1, tensor([0.1000, 0.1000]))
    """
    _param_leaves(params)
    return _convert_from_torch(_torch_param_states(source, params), tx, params, count)


def _torch_keys(optimizer: torch.optim.Optimizer, group: dict[str, Any], param: torch.Tensor) -> set[str]:
    """The per-param state keys ``optimizer`` keeps for ``param`` of ``group`` once it has stepped."""
    for cls, keys, options in _TORCH_KEYS:
        if isinstance(optimizer, cls):
            shaped = set()
            if isinstance(optimizer, torch.optim.Adafactor):
                shaped = {"row_var", "col_var"} if param.dim() > 1 else {"variance"}
            return set(keys) | shaped | {key for option, key in options.items() if group.get(option)}
    supported = ", ".join(cls.__name__ for cls, _, _ in _TORCH_KEYS)
    raise ValueError(
        f"state_to_torch converts into torch.optim's {supported} (and AdamW), not {type(optimizer).__name__}"
    )


def _torch_step(count: int, group: dict[str, Any], param: torch.Tensor) -> torch.Tensor:
    """torch.optim's ``step`` entry: on the param's device for fused and capturable groups, else on the CPU."""
    device = param.device if group.get("fused") or group.get("capturable") else torch.device("cpu")
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return torch.tensor(float(count), dtype=dtype, device=device)


def state_to_torch(
    state: PyTree, params: PyTree, optimizer: torch.optim.Optimizer, *, count: int | None = None
) -> dict[str, Any]:
    r"""Converts fadam functional state into a ``state_dict`` for ``optimizer`` (``optimizer.load_state_dict(...)``).

    The inverse of ``state_from_torch``: the moments of the fadam states listed there become torch's per-param
    entries, the step count becomes each param's ``step``. ``optimizer`` supplies the param groups (its
    hyperparameters are kept as they are) and the param order. The entries must be exactly those ``optimizer``
    keeps (``exp_avg``, ``exp_avg_sq`` and ``step`` for ``Adam``; ``square_avg``, and ``grad_avg`` and
    ``momentum_buffer`` when centered and with momentum, for ``RMSprop``; ``ASGD``'s ``eta`` and ``mu`` computed from
    the count and ``optimizer``'s hyperparameters; ...), or the conversion is refused naming
    the param, and so is state with no torch.optim counterpart. Before the first step (count 0) the state is empty,
    as torch.optim's is (``Adagrad``'s, which torch.optim fills at construction, holds the initial sums).

    ``fadam.rmsprop``, ``fadam.adagrad`` without ``lr_decay``, ``fadam.adadelta`` and ``fadam.rprop`` keep no step
    count (their updates do not depend on it): pass ``count``, the number of steps taken, which becomes torch's
    ``step``. ``Muon`` keeps no step: its momentum buffers are written as they are.

    Quantized moments (``fadam.adam8bit``) are written dequantized, their block size read from their sizes and codes
    (``fadam.quantization._full_precision``). ``fadam.lbfgs``'s state goes into ``torch.optim.LBFGS`` whole (in its
    first param's dict; no ``count``: torch keeps none). For one of bitsandbytes' Adam family (``Adam8bit``,
    ``AdamW8bit``, their paged and 32-bit variants) the Adam moments are written in its ``state_dict`` layout: 8-bit
    (encoded to the nearest value of its maps, blocks of 256) where its configuration for the param says so
    (``optim_bits`` 8 and at least ``min_8bit_size`` elements), float32 elsewhere. A paged state is refused.

    Args:
        state: the fadam state.
        params: the params, as the pytree the state was built for (a list or dict, dicts in insertion order), in the
            optimizer's order (or its own tensors).
        optimizer: the torch.optim optimizer (or one of bitsandbytes' Adam family) that continues the run.
        count: the step count written for torch (overrides the state's).

    Example:
        >>> import torch, fadam
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> tx = fadam.sgd(lr=0.1, momentum=0.9)
        >>> state = tx.update([torch.ones(2)], tx.init([w.detach()]))[1]
        >>> opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
        >>> opt.load_state_dict(fadam.state_to_torch(state, [w], opt))
        >>> opt.state[w]["momentum_buffer"]
        tensor([1., 1.])
    """
    leaves, spec = _param_leaves(params)
    if isinstance(optimizer, Optimizer):
        raise TypeError("state_to_torch converts into torch.optim optimizers; a fadam.Optimizer takes tx_states")
    state = dequantized(_unpaged(state))
    if isinstance(optimizer, torch.optim.LBFGS):
        return lbfgs_to_torch(state, params, optimizer, count)
    if is_bitsandbytes(optimizer):  # its Adam's moments, in its format
        return as_bitsandbytes(state_to_torch(state, params, adam_stand_in(optimizer), count=count), optimizer)
    sd = optimizer.state_dict()
    opt_params = [p for g in optimizer.param_groups for p in g["params"]]
    groups_of = [g for g in optimizer.param_groups for _ in g["params"]]
    indices = [i for g in sd["param_groups"] for i in g["params"]]
    if len(opt_params) != len(leaves):
        raise ValueError(f"the torch optimizer has {len(opt_params)} params but params has {len(leaves)} leaves")
    position = {id(p): i for i, p in enumerate(opt_params)}
    identical = all(id(p) in position for p in leaves)
    order = [position[id(p)] for p in leaves] if identical else _given_order(params)
    paths = [path_str(p) for p in spec.paths()]
    state_leaves = tree_leaves(state)
    slots = _slots(state, spec)
    entries, keeps_step, owners = _torch_entries(state_leaves, slots, paths, [p.dim() for p in leaves])
    for path, keys, has_step, opt_index, types in zip(paths, entries, keeps_step, order, owners):
        given = set(keys) | ({"step"} if has_step else set()) | _derived_keys(types)
        wanted = _torch_keys(optimizer, groups_of[opt_index], opt_params[opt_index])
        if given != wanted:
            raise ValueError(
                f"cannot convert the state of param {path} for {type(optimizer).__name__}: it keeps "
                f"{sorted(wanted)}, the fadam state gives {sorted(given)}"
            )
    if count is None:
        counts = {int(leaf) for leaf, slot in zip(state_leaves, slots) if slot.param is None and slot.field == "count"}
        if len(counts) > 1:
            raise ValueError(f"the fadam state holds different step counts {sorted(counts)}; torch.optim needs one")
        if not counts and any(keeps_step):
            raise ValueError(
                "the fadam state keeps no step count (rmsprop, adagrad without lr_decay, adadelta, rprop): pass count="
            )
        count = next(iter(counts), None)  # None: no param keeps a step (Muon's momentum), the entries as they are
    if count == 0 and not isinstance(optimizer, torch.optim.Adagrad):
        return {"state": {}, "param_groups": sd["param_groups"]}
    new_state = {}
    for keys, has_step, opt_index, types in zip(entries, keeps_step, order, owners):
        entry = {key: state_leaves[index].detach().clone() for key, index in keys.items()}
        group, param = groups_of[opt_index], opt_params[opt_index]
        if has_step:
            # SparseAdam keeps its step as a Python int, and computes its bias corrections from it in doubles
            sparse_adam_step = isinstance(optimizer, torch.optim.SparseAdam)
            entry["step"] = count if sparse_adam_step else _torch_step(count, group, param)  # type: ignore[arg-type]
        for owner in types & _DERIVED.keys():
            entry.update(_DERIVED[owner][1](group, param, count))  # type: ignore[arg-type]
        new_state[indices[opt_index]] = entry
    return {"state": new_state, "param_groups": sd["param_groups"]}
