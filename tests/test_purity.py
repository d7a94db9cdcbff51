"""Purity: no public transform, alias, ``apply_updates`` or ``fadam.step`` (without donation)
modifies any tensor passed in: params, updates and state are bit-identical afterwards and their version counters
did not move (so not even an in-place write of the same values happened).

Every public factory (a function in ``fadam.__all__`` that returns a ``GradientTransformation``) must have an entry
in ``FACTORIES`` below: a new factory without one fails ``test_every_public_factory_has_a_purity_entry``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch

import fadam
from tests.conformance.table import ALL_ROWS
from tests.tree_checks import assert_unchanged, snapshot, tensor_leaves


def _half_lr(count: torch.Tensor) -> torch.Tensor:
    return 0.1 * 0.5 ** count.to(torch.float64)


def _sparse_gradients(tx: fadam.GradientTransformation) -> fadam.GradientTransformation:
    """``tx``, which takes sparse gradients only, given each gradient as a sparse COO tensor; its updates are returned
    dense, as the snapshots here compare dense tensors."""

    def update(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> tuple[Any, Any]:
        sparse = fadam.tree_map(lambda g: None if g is None else g.to_sparse(), updates)
        new_updates, state = tx.update(sparse, state, params, **extra_args)
        return fadam.tree_map(lambda u: None if u is None else u.to_dense(), new_updates), state

    return fadam.GradientTransformation(tx.init, update)


# name -> builders of a transform. Give each factory its interesting configurations; ``complex`` says whether the
# transform accepts complex params (clip does not: clamp has no order on complex numbers).
FACTORIES: dict[str, list[Callable[[], fadam.GradientTransformation]]] = {
    "page_state": [
        lambda: fadam.page_state(fadam.scale_by_adam(), chunk_bytes=256, per_leaf=True),
        lambda: fadam.page_state(fadam.chain(fadam.clip_by_global_norm(1.0), fadam.trace(0.9)), storage="disk"),
    ],
    "paged_adam": [lambda: fadam.paged_adam(1e-2, chunk_bytes=256)],
    "paged_adam8bit": [lambda: fadam.paged_adam8bit(1e-2, storage="disk", min_size=0)],
    "paged_adamw": [lambda: fadam.paged_adamw(1e-2, storage="disk", chunk_bytes=256)],
    "paged_adamw8bit": [lambda: fadam.paged_adamw8bit(1e-2, min_size=0)],
    "paged_ademamix": [lambda: fadam.paged_ademamix(1e-2, storage="disk", chunk_bytes=256)],
    "paged_ademamix8bit": [lambda: fadam.paged_ademamix8bit(1e-2, min_size=0)],
    "adam4bit": [lambda: fadam.adam4bit(1e-2, min_size=0)],
    "adam8bit": [lambda: fadam.adam8bit(1e-2, min_size=0), lambda: fadam.adam8bit(1e-2, weight_decay=0.1)],
    "adamw4bit": [lambda: fadam.adamw4bit(1e-2, amsgrad=True, min_size=0)],
    "adamw8bit": [lambda: fadam.adamw8bit(1e-2, weight_decay=0.1, min_size=0)],
    "lion8bit": [lambda: fadam.lion8bit(1e-3, weight_decay=0.1, min_size=0)],
    "quantize_state": [
        lambda: fadam.quantize_state(fadam.scale_by_adam(), bits=8, min_size=0),
        lambda: fadam.quantize_state(
            fadam.trace(0.9), bits=4, min_size=0, mask={"layer": True, "extra": False, "z": True}
        ),
    ],
    "sgd8bit": [lambda: fadam.sgd8bit(1e-2, momentum=0.9, min_size=0)],
    "adafactor": [lambda: fadam.adafactor(1e-2, min_dim_size_to_factor=2), lambda: fadam.adafactor(momentum=0.9)],
    "adagrad": [lambda: fadam.adagrad(0.1), lambda: fadam.adagrad(0.1, lr_decay=1e-3, initial_accumulator_value=0.1)],
    "adamax": [lambda: fadam.adamax(1e-2, weight_decay=0.1)],
    "clip_by_block_rms": [lambda: fadam.clip_by_block_rms(0.5)],
    "ema": [lambda: fadam.ema(0.9), lambda: fadam.ema(0.9, debias=False)],
    "lamb": [lambda: fadam.lamb(1e-2, weight_decay=0.01)],
    "lion": [lambda: fadam.lion(1e-3, weight_decay=0.1)],
    "muon": [
        lambda: fadam.masked(fadam.muon(1e-2), lambda params: fadam.tree_map(lambda p: p.ndim == 2, params)),
        lambda: fadam.masked(
            fadam.muon(_half_lr, nesterov=False, adjust_lr_fn="match_rms_adamw"),
            lambda params: fadam.tree_map(lambda p: p.ndim == 2, params),
        ),
    ],
    "muon_with_adamw": [
        lambda: fadam.muon_with_adamw(0.02, adamw_lr=1e-2),
        lambda: fadam.muon_with_adamw(_half_lr, weight_decay=0.0, adamw_for=lambda path, p: "layer" in path),
    ],
    "scale_by_muon": [
        lambda: fadam.masked(fadam.scale_by_muon(), lambda params: fadam.tree_map(lambda p: p.ndim == 2, params))
    ],
    "sign_sgd": [lambda: fadam.sign_sgd(1e-2)],
    "signum": [lambda: fadam.signum(1e-2), lambda: fadam.signum(_half_lr, beta=0.5, accumulator_dtype=torch.float64)],
    "nadam": [lambda: fadam.nadam(1e-2), lambda: fadam.nadam(1e-2, weight_decay=0.1, decoupled_weight_decay=True)],
    "nadamw": [lambda: fadam.nadamw(1e-2)],
    "radam": [lambda: fadam.radam(1e-2), lambda: fadam.radam(1e-2, weight_decay=0.1, decoupled_weight_decay=True)],
    "rmsprop": [lambda: fadam.rmsprop(1e-2), lambda: fadam.rmsprop(1e-2, centered=True, momentum=0.9)],
    "scale_by_adamax": [fadam.scale_by_adamax],
    "scale_by_factored_rms": [lambda: fadam.scale_by_factored_rms(min_dim_size_to_factor=2)],
    "scale_by_lion": [fadam.scale_by_lion],
    "scale_by_nadam": [fadam.scale_by_nadam],
    "scale_by_param_block_rms": [fadam.scale_by_param_block_rms],
    "scale_by_radam": [fadam.scale_by_radam],
    "scale_by_rms": [fadam.scale_by_rms, lambda: fadam.scale_by_rms(eps_in_sqrt=False)],
    "scale_by_rss": [fadam.scale_by_rss],
    "scale_by_sparse_adam": [lambda: _sparse_gradients(fadam.scale_by_sparse_adam(b1=0.5, b2=0.9))],
    "sparse_adam": [lambda: _sparse_gradients(fadam.sparse_adam(1e-2, maximize=True))],
    "scale_by_stddev": [fadam.scale_by_stddev],
    "scale_by_trust_ratio": [fadam.scale_by_trust_ratio],
    "apply_if_finite": [
        lambda: fadam.apply_if_finite(fadam.adam(1e-2, amsgrad=True), 2),
        lambda: fadam.apply_if_finite(fadam.sgd(_half_lr, momentum=0.9), 0),
    ],
    "capturable": [
        lambda: fadam.capturable(fadam.chain(fadam.clip_by_global_norm(1.0), fadam.adamw(1e-2, weight_decay=0.1))),
        lambda: fadam.capturable(fadam.MultiSteps(fadam.adam(1e-2), 2).gradient_transformation()),
    ],
    "freeze": [lambda: fadam.freeze({"layer": {"w": True, "b": False}, "extra": False, "z": True})],
    "inject_hyperparams": [
        lambda: fadam.inject_hyperparams(fadam.adamw)(lr=_half_lr, weight_decay=0.1),
        lambda: fadam.inject_hyperparams(fadam.sgd)(
            lr=0.1, momentum=0.9, weight_decay=fadam.linear_schedule(0.1, 0, 3)
        ),
    ],
    "selective_transform": [
        lambda: fadam.selective_transform(fadam.adam(1e-2), freeze_mask={"layer": True, "extra": False, "z": False})
    ],
    "zero_nans": [fadam.zero_nans],
    "adam": [
        lambda: fadam.adam(1e-2),
        lambda: fadam.adam(1e-2, weight_decay=0.1, amsgrad=True, maximize=True),
        lambda: fadam.adam(torch.tensor(1e-2)),
        lambda: fadam.adam(_half_lr, weight_decay=torch.tensor(0.1)),
    ],
    "adamw": [
        lambda: fadam.adamw(1e-2),
        lambda: fadam.adamw(1e-2, amsgrad=True, maximize=True),
        lambda: fadam.adamw(_half_lr, weight_decay=0.1),
        lambda: fadam.adamw(torch.tensor(1e-2), weight_decay=torch.tensor(0.1)),
    ],
    "sgd": [
        lambda: fadam.sgd(1e-2),
        lambda: fadam.sgd(1e-2, momentum=0.9, dampening=0.1, weight_decay=0.1, maximize=True),
        lambda: fadam.sgd(_half_lr, momentum=0.9, nesterov=True),
        lambda: fadam.sgd(torch.tensor(1e-2), momentum=0.9, weight_decay=torch.tensor(0.1)),
    ],
    "add_decayed_weights": [
        lambda: fadam.add_decayed_weights(0.1),
        lambda: fadam.add_decayed_weights(torch.tensor(0.1), mask={"layer": True, "extra": False, "z": True}),
    ],
    "add_decoupled_weight_decay": [
        lambda: fadam.add_decoupled_weight_decay(0.1, 0.5),
        lambda: fadam.add_decoupled_weight_decay(_half_lr, 0.5),
    ],
    "chain": [lambda: fadam.chain(fadam.clip_by_global_norm(1.0), fadam.scale_by_adam(), fadam.scale(-0.1))],
    "clip": [lambda: fadam.clip(0.5)],
    "clip_by_global_norm": [lambda: fadam.clip_by_global_norm(0.5), lambda: fadam.clip_by_global_norm(100.0)],
    "identity": [fadam.identity],
    "masked": [
        lambda: fadam.masked(fadam.scale_by_adam(), {"layer": {"w": True, "b": False}, "extra": True, "z": False}),
        lambda: fadam.masked(fadam.trace(0.9), lambda params: fadam.tree_map(lambda p: p.ndim > 1, params)),
    ],
    "named_chain": [lambda: fadam.named_chain(("trace", fadam.trace(0.5)), ("lr", fadam.scale_by_learning_rate(0.1)))],
    "partition": [
        lambda: fadam.partition(
            {"adam": fadam.adam(1e-2), "sgd": fadam.sgd(0.1, momentum=0.9), "frozen": fadam.set_to_zero()},
            {"layer": {"w": "adam", "b": "sgd"}, "extra": "frozen", "z": "adam"},
        )
    ],
    "scale": [lambda: fadam.scale(-0.5), lambda: fadam.scale(torch.tensor(2.0))],
    "scale_by_adam": [
        fadam.scale_by_adam,
        lambda: fadam.scale_by_adam(eps_root=1e-8, amsgrad=True),
        lambda: fadam.scale_by_adam(nesterov=True),
    ],
    "scale_by_learning_rate": [
        lambda: fadam.scale_by_learning_rate(0.1),
        lambda: fadam.scale_by_learning_rate(torch.tensor(0.1), flip_sign=False),
        lambda: fadam.scale_by_learning_rate(_half_lr),
    ],
    "scale_by_schedule": [lambda: fadam.scale_by_schedule(_half_lr)],
    "scale_by_sign": [fadam.scale_by_sign],
    "set_to_zero": [fadam.set_to_zero],
    "stateless": [lambda: fadam.stateless(lambda updates, params: fadam.tree_scale(updates, 2.0))],
    "stateless_with_tree_map": [lambda: fadam.stateless_with_tree_map(lambda g, p: g * 2 + p.abs())],
    "trace": [
        lambda: fadam.trace(0.9),
        lambda: fadam.trace(0.9, nesterov=True),
        lambda: fadam.trace(0.9, dampening=0.5, accumulator_dtype=torch.float64),
    ],
    "adabelief": [lambda: fadam.adabelief(1e-2), lambda: fadam.adabelief(_half_lr, nesterov=True)],
    "ademamix": [lambda: fadam.ademamix(1e-2, weight_decay=0.1), lambda: fadam.ademamix(1e-2, alpha=_half_lr)],
    "ademamix8bit": [lambda: fadam.ademamix8bit(1e-2, min_size=0)],
    "adopt": [lambda: fadam.adopt(1e-2), lambda: fadam.adopt(_half_lr, nesterov=True, use_clipping=False)],
    "cautious": [
        lambda: fadam.cautious(fadam.scale_by_adam()),
        lambda: fadam.chain(fadam.cautious(fadam.scale_by_lion()), fadam.scale_by_learning_rate(1e-2)),
    ],
    "scale_by_ademamix": [fadam.scale_by_ademamix, lambda: fadam.scale_by_ademamix(b3=_half_lr, eps_root=1e-8)],
    "scale_by_adopt": [fadam.scale_by_adopt, lambda: fadam.scale_by_adopt(mu_dtype=torch.float64)],
    "scale_by_belief": [fadam.scale_by_belief],
    "scale_by_yogi": [fadam.scale_by_yogi, lambda: fadam.scale_by_yogi(eps_root=1e-8)],
    "yogi": [lambda: fadam.yogi(1e-2)],
    "adadelta": [lambda: fadam.adadelta(), lambda: fadam.adadelta(_half_lr, rho=0.5, weight_decay=0.1, maximize=True)],
    "asgd": [lambda: fadam.asgd(1e-2), lambda: fadam.asgd(_half_lr, t0=1.0, weight_decay=0.1, maximize=True)],
    "rprop": [lambda: fadam.rprop(1e-2), lambda: fadam.rprop(_half_lr, etas=(0.3, 1.5), maximize=True)],
    "adafactor_torch": [
        lambda: fadam.adafactor_torch(1e-2),
        lambda: fadam.adafactor_torch(_half_lr, eps=(1e-20, 1e-2), weight_decay=0.1, maximize=True),
    ],
    "scale_by_adadelta": [fadam.scale_by_adadelta],
    "scale_by_asgd": [fadam.scale_by_asgd, lambda: fadam.scale_by_asgd(torch.tensor(0.1), t0=0.0)],
    "scale_by_rprop": [fadam.scale_by_rprop],
    "scale_by_adafactor_torch": [fadam.scale_by_adafactor_torch],
    "schedule_free": [
        lambda: fadam.schedule_free(fadam.sgd(1e-2), 1e-2),
        lambda: fadam.schedule_free(fadam.adam(_half_lr, betas=(0.0, 0.999)), _half_lr, b1=0.8, r=1.0),
    ],
    "schedule_free_adamw": [
        lambda: fadam.schedule_free_adamw(1e-2),
        lambda: fadam.schedule_free_adamw(_half_lr, warmup_steps=2, weight_decay=0.1),
    ],
    "schedule_free_sgd": [lambda: fadam.schedule_free_sgd(0.1, warmup_steps=3, weight_decay=0.01, r=0.5)],
    "prodigy": [
        lambda: fadam.prodigy(d0=1e-3),
        lambda: fadam.prodigy(betas=(0.0, 0.99), weight_decay=0.1, decouple=False, use_bias_correction=True),
    ],
    "mars": [lambda: fadam.mars(1e-2, weight_decay=0.1), lambda: fadam.mars(_half_lr, amsgrad=True, optimize_1d=True)],
    "scale_by_mars": [fadam.scale_by_mars, lambda: fadam.scale_by_mars(gamma=0.5, max_norm=0.1)],
    "normalize": [fadam.normalize],
    "sam": [
        lambda: fadam.sam(fadam.sgd(1e-2), fadam.chain(fadam.normalize(), fadam.sgd(0.05))),
        lambda: fadam.sam(fadam.adam(1e-2), fadam.sgd(0.1), sync_period=3, reset_state=False),
    ],
}


def _lookahead_on(fast: Any, slow_of: Callable[[Any], Any]) -> fadam.GradientTransformation:
    """fadam.lookahead stepping the given params as its fast params, the slow ones ``slow_of(params)``: its updates
    of the fast params are returned (the purity check sees every input to lookahead's update but the slow params)."""
    tx = fadam.lookahead(fast, sync_period=2, slow_step_size=0.5)

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
        both, state = tx.update(updates, state, fadam.LookaheadParams(params, slow_of(params)), **extra)
        return both.fast, state

    return fadam.GradientTransformation(tx.init, update)


FACTORIES["lookahead"] = [
    lambda: _lookahead_on(
        fadam.adam(1e-2), lambda params: fadam.tree_map(lambda p: None if p is None else p * 0.5, params)
    ),
    lambda: _lookahead_on(fadam.sgd(_half_lr, momentum=0.9), lambda params: params),
]


def _lbfgs_with_value_fn(**options: Any) -> fadam.GradientTransformation:
    """fadam.lbfgs given its loss closure at every update: the sum of |p|^2 / 2, whose gradient is p."""
    tx = fadam.lbfgs(**options)

    def value_fn(params: Any) -> tuple[float, Any]:
        value = float(fadam.tree_global_norm(params)) ** 2 / 2
        return value, fadam.tree_map(lambda p: p.clone(), params)

    def update(updates: Any, state: Any, params: Any = None, **_: Any) -> tuple[Any, Any]:
        return tx.update(updates, state, params, value=value_fn(params)[0], value_fn=value_fn)

    return fadam.GradientTransformation(tx.init, update)


FACTORIES["lbfgs"] = [
    lambda: _lbfgs_with_value_fn(max_iter=4, history_size=2),
    lambda: _lbfgs_with_value_fn(lr=_half_lr, line_search_fn="strong_wolfe", max_iter=3),
]


def _with_loss(tx: fadam.GradientTransformation) -> fadam.GradientTransformation:
    """A transform that needs the loss (the Polyak step size), given |p|^2 / 2 at every update."""

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
        value = fadam.tree_global_norm(params) ** 2 / 2
        return tx.update(updates, state, params, value=value, **extra)

    return fadam.GradientTransformation(tx.init, update)


def _matrices(params: Any) -> Any:
    return fadam.tree_map(lambda p: p.ndim >= 2, params)


FACTORIES.update(
    {
        "novograd": [lambda: fadam.novograd(1e-2, weight_decay=0.1)],
        "scale_by_novograd": [
            fadam.scale_by_novograd,
            lambda: fadam.scale_by_novograd(eps_root=1e-8, mu_dtype=torch.float64),
        ],
        "lars": [
            lambda: fadam.lars(1e-2, weight_decay=1e-3),
            lambda: fadam.lars(_half_lr, trust_ratio_mask=_matrices, weight_decay_mask=_matrices, nesterov=True),
        ],
        "adan": [lambda: fadam.adan(1e-2, weight_decay=0.1), lambda: fadam.adan(_half_lr, mask=_matrices)],
        "scale_by_adan": [fadam.scale_by_adan],
        "sm3": [lambda: fadam.sm3(1e-2)],
        "scale_by_sm3": [lambda: fadam.scale_by_sm3(b1=0.5, b2=0.9)],
        "fromage": [lambda: fadam.fromage(1e-2), lambda: fadam.fromage(_half_lr)],
        "noisy_sgd": [lambda: fadam.noisy_sgd(1e-2, key=0)],
        "add_noise": [lambda: fadam.add_noise(0.01, 0.55, key=1)],
        "polyak_sgd": [lambda: _with_loss(fadam.polyak_sgd(scaling=0.5, variant="sps+"))],
        "scale_by_polyak": [lambda: _with_loss(fadam.scale_by_polyak(f_min=0.1, eps=1e-3))],
        "optimistic_gradient_descent": [lambda: fadam.optimistic_gradient_descent(1e-2, alpha=0.5)],
        "optimistic_adam": [
            lambda: fadam.optimistic_adam(1e-2),
            lambda: fadam.optimistic_adam(1e-2, 0.1, nesterov=False),
        ],
        "scale_by_optimistic_gradient": [fadam.scale_by_optimistic_gradient],
        "centralize": [fadam.centralize],
        "adaptive_grad_clip": [lambda: fadam.adaptive_grad_clip(0.1)],
        "normalize_by_update_norm": [fadam.normalize_by_update_norm],
        "keep_params_nonnegative": [fadam.keep_params_nonnegative],
        "apply_every": [lambda: fadam.apply_every(2)],
        "conditionally_mask": [lambda: fadam.conditionally_mask(fadam.adam(1e-2), lambda step: step % 2 == 0)],
        "conditionally_transform": [
            lambda: fadam.conditionally_transform(fadam.trace(0.9), lambda step: step != 1),
        ],
        "optimistic_adam_v2": [
            lambda: fadam.optimistic_adam_v2(1e-2),
            lambda: fadam.optimistic_adam_v2(_half_lr, alpha=0.5, beta=2.0, nesterov=False),
        ],
        "flatten": [lambda: fadam.flatten(fadam.adam(1e-2)), lambda: fadam.flatten(fadam.lars(1e-2))],
        "snapshot": [lambda: fadam.chain(fadam.snapshot("norm", fadam.tree_norm), fadam.sgd(1e-2))],
        "monitor": [
            lambda: fadam.chain(
                fadam.monitor({"norm": fadam.tree_norm, "ema": fadam.measure_with_ema(fadam.tree_norm, 0.9)}),
                fadam.sgd(1e-2),
            )
        ],
        "measure_with_ema": [
            lambda: fadam.chain(
                fadam.monitor({"large": fadam.measure_with_ema(lambda u: fadam.tree_norm(u) > 1.0, 0.9)}),
                fadam.adam(1e-2),
            )
        ],
        "soap": [
            lambda: fadam.soap(1e-2, precondition_frequency=2),
            lambda: fadam.soap(_half_lr, weight_decay=_half_lr, merge_dims=True, normalize_grads=True),
        ],
        "scale_by_soap": [lambda: fadam.scale_by_soap(precondition_frequency=2, precondition_1d=True)],
        "shampoo": [
            lambda: fadam.shampoo(1e-2),
            lambda: fadam.shampoo(
                _half_lr, momentum=0.9, use_nesterov=True, weight_decay=0.1, grafting="adagrad", precondition_1d=True
            ),
        ],
        "scale_by_shampoo": [lambda: fadam.scale_by_shampoo(b2=0.99, grafting="adam", precondition_frequency=2)],
        "psgd_kron": [
            lambda: fadam.psgd_kron(1e-2),
            lambda: fadam.psgd_kron(
                _half_lr, weight_decay=0.1, preconditioner_update_probability=0.5, partition_grads=True, block_size=2
            ),
        ],
        "scale_by_psgd_kron": [
            lambda: fadam.scale_by_psgd_kron(
                min_ndim_triangular=1, memory_save_mode="one_diag", momentum_into_precond_update=False
            )
        ],
        "multi_transform": [
            lambda: fadam.multi_transform(
                {"adan": fadam.adan(1e-2), "sgd": fadam.sgd(1e-2)},
                lambda params: fadam.tree_map(lambda p: "adan" if p.ndim >= 2 else "sgd", params),
            )
        ],
    }
)


class _Halving:
    """A stateful schedule (``inject_stateful_hyperparams``): 0.1, halved at every update."""

    def init(self) -> torch.Tensor:
        return torch.tensor(0.1, dtype=torch.float64)

    def update(self, state: torch.Tensor, **_: Any) -> torch.Tensor:
        return state / 2

    def __call__(self, state: torch.Tensor, **_: Any) -> torch.Tensor:
        return state


def _with_line_search_args(tx: fadam.GradientTransformation) -> fadam.GradientTransformation:
    """A chain ending in a line search, given |p|^2 / 2 as its loss at every update (whose gradient is p)."""

    def value_fn(params: Any) -> torch.Tensor:
        return sum((leaf.abs() ** 2).sum() for _, leaf in tensor_leaves(params)) / 2

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
        grad = fadam.tree_map(lambda p: None if p is None else p.clone(), params)
        return tx.update(updates, state, params, value=value_fn(params), grad=grad, value_fn=value_fn, **extra)

    return fadam.GradientTransformation(tx.init, update)


def _bare(tx: fadam.GradientTransformation) -> fadam.GradientTransformation:
    """``tx`` behind an update that takes no extra arguments (what ``with_extra_args_support`` wraps)."""
    return fadam.GradientTransformation(tx.init, lambda updates, state, params=None: tx.update(updates, state, params))


FACTORIES.update(
    {
        "adamaxw": [lambda: fadam.adamaxw(_half_lr, weight_decay=0.1)],
        "amsgrad": [lambda: fadam.amsgrad(1e-2, bias_correction_mu=False)],
        "scale_by_amsgrad": [lambda: fadam.scale_by_amsgrad(eps_root=1e-8, bias_correction_nu=False)],
        "scale_by_distance_over_gradients": [
            fadam.scale_by_distance_over_gradients,
            lambda: fadam.scale_by_distance_over_gradients(reps_rel=1e-2, param_dtype=None, global_scale=-1.0),
        ],
        "scale_by_param_block_norm": [fadam.scale_by_param_block_norm],
        "scale_by_lbfgs": [
            lambda: fadam.chain(fadam.scale_by_lbfgs(memory_size=2), fadam.scale(-0.1)),
            lambda: fadam.chain(fadam.scale_by_lbfgs(scale_init_precond=False), fadam.scale(-0.1)),
        ],
        "scale_by_zoom_linesearch": [
            lambda: _with_line_search_args(fadam.chain(fadam.scale(-1.0), fadam.scale_by_zoom_linesearch(8))),
        ],
        "scale_by_backtracking_linesearch": [
            lambda: _with_line_search_args(
                fadam.chain(fadam.scale(-1.0), fadam.scale_by_backtracking_linesearch(8, store_grad=True))
            ),
        ],
        "with_extra_args_support": [
            lambda: fadam.with_extra_args_support(fadam.adam(1e-2)),
            lambda: fadam.with_extra_args_support(_bare(fadam.sgd(1e-2, momentum=0.9))),
        ],
        "inject_stateful_hyperparams": [
            lambda: fadam.inject_stateful_hyperparams(fadam.sgd)(
                lr=_Halving(), momentum=0.9, weight_decay=fadam.linear_schedule(0.1, 0, 3)
            ),
        ],
    }
)
REAL_ONLY = {"clip"}  # factories whose transforms reject complex params, by definition
REAL_ONLY |= {"adafactor_torch", "scale_by_adafactor_torch"}  # as torch.optim.Adafactor
REAL_ONLY |= {"sm3", "scale_by_sm3"}  # as optax (maxima of the accumulator)
REAL_ONLY |= {"sparse_adam", "scale_by_sparse_adam"}  # as torch.optim.SparseAdam (and fadam takes no complex sparse)
REAL_ONLY |= {"soap", "scale_by_soap", "shampoo", "scale_by_shampoo"}  # real statistics and eigenbases
REAL_ONLY |= {"psgd_kron", "scale_by_psgd_kron"}  # real triangular factors
# factories whose state is a handle to storage outside the tensors (paged state): torch.func refuses them
HANDLE_STATE = {"page_state", "paged_adam", "paged_adam8bit", "paged_adamw", "paged_adamw8bit"}
HANDLE_STATE |= {"paged_ademamix", "paged_ademamix8bit"}


def _returns_transform(obj: Any) -> bool:
    """A public factory: annotated to return a GradientTransformation, or returning one when called without args."""
    try:
        annotation = inspect.signature(obj).return_annotation
    except (TypeError, ValueError):
        annotation = inspect.Signature.empty
    if "GradientTransformation" in str(annotation):
        return True
    try:
        return isinstance(obj(), fadam.GradientTransformation)
    except Exception:
        return False


def _public_factories() -> set[str]:
    names = set()
    for name in fadam.__all__:
        obj = getattr(fadam, name)
        if callable(obj) and not isinstance(obj, type) and _returns_transform(obj):
            names.add(name)
    return names


def test_every_public_factory_has_a_purity_entry():
    factories = _public_factories()
    missing = sorted(factories - FACTORIES.keys())
    assert not missing, f"public transform factories without a purity entry in tests/test_purity.py: {missing}"
    stale = sorted(FACTORIES.keys() - factories)
    assert not stale, f"purity entries for names that are not public factories: {stale}"
    assert {"adam", "adamw", "sgd", "chain", "masked", "partition"} <= factories  # the discovery finds factories


def _params(complex_leaf: bool) -> dict:
    gen = torch.Generator().manual_seed(0)
    params: dict[str, Any] = {
        "layer": {"w": torch.randn(3, 4, generator=gen), "b": torch.randn(4, generator=gen)},
        "extra": [torch.randn(2, generator=gen, dtype=torch.float64), torch.tensor(1.5)],
    }
    if complex_leaf:
        params["z"] = torch.randn(3, generator=gen, dtype=torch.complex64)
    return params


def _grads(params: dict, steps: int) -> list[dict]:
    """Gradients for ``steps`` steps; the second step has a ``None`` gradient (that param is skipped)."""
    gen = torch.Generator().manual_seed(1)
    grads = []
    for index in range(steps):
        g = fadam.tree_map(lambda p: torch.randn(p.shape, generator=gen, dtype=p.dtype), params)
        if index == 1:
            g["layer"]["b"] = None
        grads.append(g)
    return grads


def check_purity(tx: fadam.GradientTransformation, params: Any, grads: list[Any], handle: bool = False) -> None:
    """Runs init, then per step update, apply_updates and fadam.step, proving every input is left untouched.

    ``handle``: the state is a handle to storage outside the tensors (paged state), whose update writes the storage's
    spare slot by design; params, gradients and updates are still checked, and ``fadam.step`` runs on its own handle.
    """
    before = snapshot(params)
    state = tx.init(params)
    step_state = tx.init(params) if handle else state
    assert_unchanged(before, "init: params")
    for index, g in enumerate(grads):
        inputs = snapshot(params), snapshot(g), snapshot(state if not handle else None)
        updates, new_state = tx.update(g, state, params, unused_extra_arg=torch.ones(2))
        for snap, what in zip(inputs, ("params", "updates", "state")):
            assert_unchanged(snap, f"step {index}, update: {what}")

        applied = snapshot(params), snapshot(updates)
        new_params = fadam.apply_updates(params, updates)
        for snap, what in zip(applied, ("params", "updates")):
            assert_unchanged(snap, f"step {index}, apply_updates: {what}")

        stepped = snapshot(params), snapshot(g), snapshot(step_state if not handle else None)
        step_params, stepped_state = fadam.step(tx, params, g, step_state)
        for snap, what in zip(stepped, ("params", "grads", "state")):
            assert_unchanged(snap, f"step {index}, fadam.step: {what}")
        for (path, a), (_, b) in zip(tensor_leaves(step_params), tensor_leaves(new_params), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=path)  # both paths computed the same step
        params, state = new_params, new_state
        step_state = stepped_state if handle else new_state


@pytest.mark.parametrize(
    ("name", "index"), [(name, index) for name, builders in FACTORIES.items() for index in range(len(builders))]
)
def test_public_factory_is_pure(name, index):
    params = _params(complex_leaf=name not in REAL_ONLY)
    check_purity(FACTORIES[name][index](), params, _grads(params, steps=3), handle=name in HANDLE_STATE)


@pytest.mark.parametrize("row", ALL_ROWS, ids=str)
def test_conformance_row_is_pure(row):
    params = _params(complex_leaf=row.complex_params)
    check_purity(row.build(), params, _grads(params, steps=3), handle=not row.value_state)


def test_purity_check_detects_in_place_writes():
    """The check can fail: an update that writes into its input (even the same values) is caught."""

    def sneaky(updates: Any, params: Any) -> Any:
        updates["layer"]["w"].mul_(1.0)
        return updates

    params = _params(complex_leaf=False)
    with pytest.raises(AssertionError, match="written in place"):
        check_purity(fadam.stateless(sneaky), params, _grads(params, steps=1))


def test_tree_math_is_pure():
    params = _params(complex_leaf=True)
    other = _grads(params, steps=1)[0]
    other["layer"]["b"] = torch.ones(4)
    snaps = snapshot(params), snapshot(other)
    fadam.tree_add(params, other, alpha=0.5)
    fadam.tree_sub(params, other)
    fadam.tree_scale(params, 3.0)
    fadam.tree_zeros_like(params)
    fadam.tree_cast(params, torch.float64)
    fadam.tree_global_norm(params)
    fadam.global_norm(other)
    fadam.tree_map(lambda p: p * 2, params)
    fadam.tree_paths(params)
    assert_unchanged(snaps[0], "params")
    assert_unchanged(snaps[1], "other")


@pytest.mark.parametrize("row", ALL_ROWS, ids=str)
def test_donating_step_leaves_gradients_alone(row):
    """``donate=True`` gives up params and state only: the gradients passed in stay bit-identical."""
    params = _params(complex_leaf=row.complex_params)
    tx = row.build()
    state = tx.init(params)
    for g in _grads(params, steps=3):
        before = snapshot(g)
        params, state = fadam.step(tx, params, g, state, donate=True)
        assert_unchanged(before, "grads")
