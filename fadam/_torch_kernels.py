"""Torch's own fused kernels for the runs of declarations that they compute exactly.

``torch._fused_adam_``, ``_fused_adamw_``, ``_fused_sgd_`` and ``_fused_adagrad_`` (CPU and CUDA in torch 2.13) are
what ``torch.optim``'s ``fused=True`` runs. A program that is one of their chains (one segment that steps from the
gradients, its declarations in the order the aliases build them) is recognized here from the declarations' names and
``options`` (their hyperparameters), wherever it comes from: an alias, a user's ``chain`` of the same members, a
``masked`` or ``partition`` branch, an ``inject_hyperparams`` inner transform. The executor (``fadam._execute``) then
runs the kernel on the leaves that allow it, so that ``fadam.adamw`` steps exactly as ``torch.optim.AdamW(fused=True)``
(``fadam.backend("kernel")`` keeps such a program on the generated kernel, whose numbers are the eager path's):

- Adam: ``[scale(-1)] [add_decayed_weights] scale_by_adam scale_by_learning_rate [add_decoupled_weight_decay]``;
- SGD: ``[scale(-1)] [add_decayed_weights] [trace] scale_by_learning_rate``;
- Adagrad: ``[scale(-1)] [add_decayed_weights] scale_by_rss(eps_in_sqrt=False) scale_by_learning_rate``.

A hyperparameter inside the kernel's math must be a number (a tensor may be learned, a schedule is not a number);
the learning rate and a coupled weight decay are read from the step's scalars, so schedules of them are served. A
tensor learning rate and the step (a count on the device under ``fadam.capturable``) reach the kernels as tensors,
as torch.optim's capturable mode gives them; SGD's kernel takes whether it is the first step as a flag, so it runs
only where the count is read for free.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from fadam._numerics import is_first_step, is_resident, safe_increment
from fadam._program import Elementwise

Leaves = list[torch.Tensor]


class TorchKernel(NamedTuple):
    """A torch kernel bound to one step's hyperparameters: ``run(device, params, grads, *slot_lists)`` steps leaves of
    one device and dtype in place (the slot lists in the declarations' order of slots)."""

    name: str
    run: Callable[..., None]
    takes_complex: bool


class _Shape(NamedTuple):
    """Where the members of a recognized run sit among its declarations."""

    kind: str  # "adam", "sgd" or "adagrad"
    maximize: bool
    coupled: int | None  # add_decayed_weights
    core: int | None  # scale_by_adam, trace or scale_by_rss
    lr: int
    decoupled: int | None  # add_decoupled_weight_decay


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _same(a: Any, b: Any) -> bool:
    """The same learning rate: one schedule or tensor, or equal numbers."""
    return a is b or (_number(a) and _number(b) and a == b)


def _is(decl: Elementwise, name: str) -> bool:
    return decl.name == name and bool(decl.options)


@functools.lru_cache(maxsize=256)
def shape_of(decls: tuple[Elementwise, ...]) -> _Shape | None:
    """Which torch kernel's chain ``decls`` are, from their names and the hyperparameters that do not change between
    steps; ``None`` if they are none."""
    at = 0
    first = decls[0] if decls else None
    maximize = first is not None and _is(first, "scale") and _number(first.option("step_size"))
    maximize = maximize and first.option("step_size") == -1.0
    at += maximize
    coupled = at if at < len(decls) and _is(decls[at], "add_decayed_weights") else None
    at += coupled is not None
    kind = _core_kind(decls[at]) if at < len(decls) else None
    core = None
    if kind is None:
        kind = "sgd"  # SGD without momentum keeps no state
    else:
        core, at = at, at + 1
    if at >= len(decls) or not _is(decls[at], "scale_by_learning_rate") or not decls[at].option("flip_sign"):
        return None
    lr, at = at, at + 1
    decoupled = None
    if kind == "adam" and coupled is None and at < len(decls) and _is(decls[at], "add_decoupled_weight_decay"):
        decay = decls[at]
        same_lr = _same(decay.option("learning_rate"), decls[lr].option("learning_rate"))
        if not same_lr or not _number(decay.option("weight_decay")):
            return None
        decoupled, at = at, at + 1
    if at != len(decls):
        return None
    return _Shape(kind, maximize, coupled, core, lr, decoupled)


def _core_kind(decl: Elementwise) -> str | None:
    """The kernel whose state ``decl`` keeps, if its fixed hyperparameters are ones the kernel takes."""
    if _is(decl, "scale_by_adam"):
        fixed = all(_number(decl.option(name)) for name in ("b1", "b2", "eps", "eps_root"))
        return "adam" if fixed and decl.option("eps_root") == 0 and not decl.option("nesterov") else None
    if _is(decl, "trace"):
        return "sgd" if all(_number(decl.option(name)) for name in ("decay", "dampening")) else None
    if _is(decl, "scale_by_rss"):
        return "adagrad" if not decl.option("eps_in_sqrt") and _number(decl.option("eps")) else None
    return None


def torch_kernel(
    decls: tuple[Elementwise, ...], states: Sequence[Any], scalars: Sequence[dict[str, Any]], device_type: str
) -> TorchKernel | None:
    """The torch kernel that computes ``decls`` for this step (their states and scalars), or ``None``."""
    shape = shape_of(decls)
    if shape is None:
        return None
    lr = -scalars[shape.lr]["step_size"]
    if isinstance(lr, torch.Tensor):
        # CUDA kernels read a tensor lr through a float pointer, and refuse a float64 one (a schedule's value): no host
        # sync; the CPU ones read it as a double, as a number, which a capturable step (fadam.capturable) gives them
        # so that nothing is read on the host and a captured graph reads each step's lr
        if device_type != "cpu":
            lr = lr.detach().to(torch.float32)
        else:
            lr = lr.detach() if is_resident() else float(lr)
    elif not _number(lr):
        return None
    weight_decay = 0.0
    if shape.coupled is not None:
        weight_decay = scalars[shape.coupled]["weight_decay"]
        if not _number(weight_decay):
            return None
    if shape.kind == "adam":
        return _adam(decls, states, shape, lr, weight_decay)
    if shape.kind == "sgd":
        return _sgd(decls, states, shape, lr, weight_decay)
    return _adagrad(decls, shape, lr, weight_decay)


def _on(value: float | torch.Tensor, device: torch.device) -> float | torch.Tensor:
    """A tensor lr on ``device`` (in the dtype ``torch_kernel`` gave it for the kernel's device type)."""
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _adam(
    decls: tuple[Elementwise, ...], states: Sequence[Any], shape: _Shape, lr: Any, weight_decay: float
) -> TorchKernel:
    adam = decls[shape.core]
    amsgrad = adam.option("amsgrad")
    decoupled = shape.decoupled is not None
    if decoupled:
        weight_decay = decls[shape.decoupled].option("weight_decay")
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    step = safe_increment(states[shape.core].count).to(torch.float32)

    def run(device: torch.device, params: Leaves, grads: Leaves, mu: Leaves, nu: Leaves, *nu_max: Leaves) -> None:
        kernel(
            params,
            grads,
            mu,
            nu,
            nu_max[0] if amsgrad else [],
            [step.to(device)] * len(params),
            lr=_on(lr, device),
            beta1=adam.option("b1"),
            beta2=adam.option("b2"),
            weight_decay=weight_decay,
            eps=adam.option("eps"),
            amsgrad=amsgrad,
            maximize=shape.maximize,
        )

    return TorchKernel("torch._fused_adamw_" if decoupled else "torch._fused_adam_", run, True)


def _sgd(
    decls: tuple[Elementwise, ...], states: Sequence[Any], shape: _Shape, lr: Any, weight_decay: float
) -> TorchKernel | None:
    trace = decls[shape.core] if shape.core is not None else None
    # the kernel takes whether this is the first step (which copies the gradient into the buffer) as a flag: where the
    # count cannot be read for free (on a device, in a capturable step) the generated kernel or eager ops run instead
    first_step = trace is not None and is_first_step(states[shape.core].count)
    if isinstance(first_step, torch.Tensor):
        return None

    def run(device: torch.device, params: Leaves, grads: Leaves, *buffers: Leaves) -> None:
        torch._fused_sgd_(
            params,
            grads,
            buffers[0] if buffers else [],
            weight_decay=weight_decay,
            momentum=trace.option("decay") if trace is not None else 0.0,
            lr=_on(lr, device),
            dampening=trace.option("dampening") if trace is not None else 0.0,
            nesterov=trace.option("nesterov") if trace is not None else False,
            maximize=shape.maximize,
            is_first_step=first_step,
        )

    return TorchKernel("torch._fused_sgd_", run, True)


def _adagrad(decls: tuple[Elementwise, ...], shape: _Shape, lr: Any, weight_decay: float) -> TorchKernel:
    # the step's lr is already decayed (fadam.adagrad's schedule computes torch's lr / (1 + (step - 1) * lr_decay)
    # alike): the kernel takes it with no decay of its own, for which the step it is given does not matter; made on
    # the device by a fill, not copied from the host, which a captured graph could not replay
    def run(device: torch.device, params: Leaves, grads: Leaves, sums: Leaves) -> None:
        torch._fused_adagrad_(
            params,
            grads,
            sums,
            [torch.ones([], dtype=torch.float32, device=device)] * len(params),
            lr=_on(lr, device),
            lr_decay=0.0,
            weight_decay=weight_decay,
            eps=decls[shape.core].option("eps"),
            maximize=shape.maximize,
        )

    return TorchKernel("torch._fused_adagrad_", run, False)
