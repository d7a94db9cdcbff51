"""Fused steps for the aliases that match a torch fused kernel (``torch._fused_adam_``, ``_fused_adamw_``,
``_fused_sgd_``; CPU and CUDA in torch 2.13).

Each builder returns a ``FusedStep`` for ``fadam.step``: it reads the alias's chain state, runs the kernel on every
(device, dtype) group, and returns ``(params, state)`` laid out exactly as the chain's own ``update`` would leave them,
or ``None`` when the kernel cannot serve these inputs. Without donation it runs on copies, so nothing passed in changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fadam._base import EmptyState, FusedStep, ScalarOrSchedule
from fadam._dispatch import can_fuse, group_by_device_dtype, is_plain, real_view
from fadam._numerics import safe_increment
from fadam._tree import PyTree, check_leaves
from fadam.transforms._adam import ScaleByAdamState, ScaleByAmsgradState
from fadam.transforms._momentum import TraceState
from fadam.transforms._rms import ScaleByRssState
from fadam.transforms._scaling import ScaleByScheduleState


def _learning_rate(lr: ScalarOrSchedule, lr_state: Any) -> float | torch.Tensor | None:
    """The learning rate for this step (a schedule is read at its count); ``None`` if it needs autograd."""
    value = lr(lr_state.count) if callable(lr) else lr
    if isinstance(value, torch.Tensor):
        if not is_plain(value):
            return None
        return value.detach()
    return value


def _any_tensor(*hyperparams: Any) -> bool:
    return any(isinstance(h, torch.Tensor) for h in hyperparams)


def _advance(state: Any) -> Any:
    """The state a count-only member of the chain (schedules, stateless transforms) has after one step."""
    return ScaleByScheduleState(safe_increment(state.count)) if isinstance(state, ScaleByScheduleState) else state


def _own_state(state: Any, members: int, index: int | None, kind: type) -> bool:
    """Whether ``state`` is laid out as the alias's chain leaves it: a tuple of ``members`` states, ``kind`` at
    ``index`` and count-only states elsewhere (what ``_advance`` steps). Another state is left to the chain's
    ``update``, whose members refuse it naming what they expected."""
    return (
        isinstance(state, tuple)
        and len(state) == members
        and all(
            isinstance(s, kind) if i == index else isinstance(s, (ScaleByScheduleState, EmptyState))
            for i, s in enumerate(state)
        )
    )


def _lr_for(value: float | torch.Tensor, device: torch.device) -> float | torch.Tensor:
    """CPU kernels take the lr as a double; CUDA kernels read a tensor lr on the device, with no host sync."""
    if isinstance(value, torch.Tensor):
        return value.to(device) if device.type != "cpu" else float(value)
    return value


def _run_groups(
    tensor_lists: list[list[torch.Tensor]], kernel: Callable[..., None], donate: bool
) -> list[list[torch.Tensor]]:
    """Runs ``kernel(device, *lists)`` once per (device, dtype) group on real views; returns the lists written to.

    ``tensor_lists[1]`` holds the gradients, which kernels only read; the others are written unless copied first.
    """
    if not donate:
        tensor_lists = [lst if i == 1 else [t.clone() for t in lst] for i, lst in enumerate(tensor_lists)]
    for (device, _), indices in group_by_device_dtype(tensor_lists[0]).items():
        kernel(device, *[[real_view(lst[i]) for i in indices] for lst in tensor_lists])
    return tensor_lists


def fused_adam_step(
    *,
    adam_index: int,
    lr: ScalarOrSchedule,
    b1: float,
    b2: float,
    eps: float,
    weight_decay: ScalarOrSchedule,
    amsgrad: bool,
    maximize: bool,
    decoupled: bool,
    members: int,
) -> FusedStep:
    kernel_fn = torch._fused_adamw_ if decoupled else torch._fused_adam_
    adam_kind = ScaleByAmsgradState if amsgrad else ScaleByAdamState

    def fused_step(params: PyTree, grads: PyTree, state: PyTree, donate: bool) -> tuple[PyTree, PyTree] | None:
        # the kernel takes numbers: a tensor may carry a graph, a schedule is not a number
        if _any_tensor(weight_decay, b1, b2, eps) or callable(weight_decay):
            return None
        if not _own_state(state, members, adam_index, adam_kind):
            return None
        grad_leaves, param_leaves, spec = check_leaves(grads, params, what="grads")
        adam_state = state[adam_index]
        mus = check_leaves(adam_state.mu, params, what="Adam state mu")[0]
        nus = spec.flatten_up_to(adam_state.nu)
        nu_maxes = spec.flatten_up_to(adam_state.nu_max) if amsgrad else []
        if not can_fuse([*param_leaves, *grad_leaves, *mus, *nus, *nu_maxes]):
            return None
        if any(
            not (p.dtype == g.dtype == m.dtype == v.dtype) for p, g, m, v in zip(param_leaves, grad_leaves, mus, nus)
        ):
            return None
        lr_value = _learning_rate(lr, state[adam_index + 1])
        if lr_value is None:
            return None
        count = safe_increment(adam_state.count)
        step_value = count.to(torch.float32)

        def kernel(device: torch.device, p: list, g: list, m: list, v: list, *vmax: list) -> None:
            kernel_fn(
                p,
                g,
                m,
                v,
                vmax[0] if amsgrad else [],
                [step_value.to(device)] * len(p),
                lr=_lr_for(lr_value, device),
                beta1=b1,
                beta2=b2,
                weight_decay=weight_decay,
                eps=eps,
                amsgrad=amsgrad,
                maximize=maximize,
            )

        lists = [param_leaves, grad_leaves, mus, nus] + ([nu_maxes] if amsgrad else [])
        with torch.no_grad():
            new_params, _, new_mus, new_nus, *new_max = _run_groups(lists, kernel, donate)
        if amsgrad:
            new_adam = ScaleByAmsgradState(
                count, spec.unflatten(new_mus), spec.unflatten(new_nus), spec.unflatten(new_max[0])
            )
        else:
            new_adam = ScaleByAdamState(count, spec.unflatten(new_mus), spec.unflatten(new_nus))
        new_state = tuple(new_adam if i == adam_index else _advance(s) for i, s in enumerate(state))
        return spec.unflatten(new_params), new_state

    return fused_step


def fused_sgd_step(
    *,
    trace_index: int | None,
    lr: ScalarOrSchedule,
    momentum: float,
    dampening: float,
    weight_decay: ScalarOrSchedule,
    nesterov: bool,
    maximize: bool,
    members: int,
) -> FusedStep:
    def fused_step(params: PyTree, grads: PyTree, state: PyTree, donate: bool) -> tuple[PyTree, PyTree] | None:
        if _any_tensor(weight_decay, momentum, dampening) or callable(weight_decay):
            return None
        if not _own_state(state, members, trace_index, TraceState):
            return None
        grad_leaves, param_leaves, spec = check_leaves(grads, params, what="grads")
        bufs = (
            check_leaves(state[trace_index].trace, params, what="momentum state")[0] if trace_index is not None else []
        )
        if not can_fuse([*param_leaves, *grad_leaves, *bufs]):
            return None
        if any(p.dtype != g.dtype for p, g in zip(param_leaves, grad_leaves)) or any(
            b.dtype != p.dtype for b, p in zip(bufs, param_leaves)
        ):
            return None
        lr_value = _learning_rate(lr, state[-1])
        if lr_value is None:
            return None
        first_step = trace_index is not None and bool(state[trace_index].count == 0)

        def kernel(device: torch.device, p: list, g: list, *buf: list) -> None:
            torch._fused_sgd_(
                p,
                g,
                buf[0] if buf else [],
                weight_decay=weight_decay,
                momentum=momentum,
                lr=_lr_for(lr_value, device),
                dampening=dampening,
                nesterov=nesterov,
                maximize=maximize,
                is_first_step=first_step,
            )

        lists = [param_leaves, grad_leaves] + ([bufs] if trace_index is not None else [])
        with torch.no_grad():
            new_params, _, *new_bufs = _run_groups(lists, kernel, donate)
        new_state = tuple(
            TraceState(safe_increment(s.count), spec.unflatten(new_bufs[0])) if i == trace_index else _advance(s)
            for i, s in enumerate(state)
        )
        return spec.unflatten(new_params), new_state

    return fused_step


def fused_adagrad_step(
    *,
    rss_index: int,
    lr: ScalarOrSchedule,
    lr_decay: float,
    weight_decay: float | torch.Tensor,
    eps: float,
    maximize: bool,
    members: int,
) -> FusedStep:
    """``torch._fused_adagrad_`` for ``fadam.adagrad`` (real params; the kernel has no complex support)."""

    def fused_step(params: PyTree, grads: PyTree, state: PyTree, donate: bool) -> tuple[PyTree, PyTree] | None:
        if any(isinstance(x, torch.Tensor) for x in (weight_decay, lr_decay, eps)):
            return None
        if not _own_state(state, members, rss_index, ScaleByRssState):
            return None
        grad_leaves, param_leaves, spec = check_leaves(grads, params, what="grads")
        sums = check_leaves(state[rss_index].sum_of_squares, params, what="Adagrad state")[0]
        if not can_fuse([*param_leaves, *grad_leaves, *sums]) or any(p.is_complex() for p in param_leaves):
            return None
        if any(not (p.dtype == g.dtype == s.dtype) for p, g, s in zip(param_leaves, grad_leaves, sums)):
            return None
        lr_state = state[rss_index + 1]
        lr_value = _learning_rate(lr, lr_state)
        if lr_value is None:
            return None
        # the kernel's lr is lr / (1 + (step - 1) * lr_decay): it needs the step only when lr_decay is set, and then
        # the chain's lr schedule state holds it (count = step - 1)
        counted = isinstance(lr_state, ScaleByScheduleState)
        step_value = (safe_increment(lr_state.count) if counted else torch.ones([], dtype=torch.int32)).to(
            torch.float32
        )

        def kernel(device: torch.device, p: list, g: list, s: list) -> None:
            torch._fused_adagrad_(
                p,
                g,
                s,
                [step_value.to(device)] * len(p),
                lr=_lr_for(lr_value, device),
                lr_decay=lr_decay,
                weight_decay=weight_decay,
                eps=eps,
                maximize=maximize,
            )

        with torch.no_grad():
            new_params, _, new_sums = _run_groups([param_leaves, grad_leaves, sums], kernel, donate)
        new_state = tuple(
            type(s)(spec.unflatten(new_sums)) if i == rss_index else _advance(s) for i, s in enumerate(state)
        )
        return spec.unflatten(new_params), new_state

    return fused_step
