"""Rows for ADOPT, AdEMAMix, Yogi, AdaBelief and the cautious wrapper. Reference "equations": the first four are
checked against optax's float64 trajectories and the cautious rows against the paper's equations in
tests/test_modern_optimizers.py."""

from __future__ import annotations

import torch

import fadam
from tests.conformance.table import Row


def cautious_adamw(
    lr: float = 1e-3, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0
) -> fadam.GradientTransformation:
    """C-AdamW: Adam's direction masked by the gradient's sign, then decoupled decay (not masked) and the lr."""
    decay = [fadam.add_decayed_weights(weight_decay)] if weight_decay else []
    return fadam.chain(fadam.cautious(fadam.scale_by_adam(b1, b2, eps)), *decay, fadam.scale_by_learning_rate(lr))


def cautious_lion(lr: float = 1e-4, b1: float = 0.9, b2: float = 0.99) -> fadam.GradientTransformation:
    """C-Lion: Lion's sign direction masked by the gradient's sign."""
    return fadam.chain(fadam.cautious(fadam.scale_by_lion(b1, b2)), fadam.scale_by_learning_rate(lr))


ROWS: list[Row] = [
    Row("adopt", fadam.adopt, {"learning_rate": 1e-2}, reference="equations"),
    # Rosenbrock's gradient from (-1, 1) is 0 along y on the first step, so ADOPT's second moment is 0 there and the
    # next normalized gradient is g / eps: unclipped, the step is 1e4 times the lr (the instability the paper's
    # clipping removes), so this row converges with the clipping on
    Row(
        "adopt-nesterov-unclipped",
        fadam.adopt,
        {"learning_rate": 1e-2, "b2": 0.999, "nesterov": True, "use_clipping": False},
        reference="equations",
        converge_kwargs={"use_clipping": True},
    ),
    Row("ademamix", fadam.ademamix, {"learning_rate": 1e-2, "b3": 0.999, "alpha": 2.0}, reference="equations"),
    Row(
        "ademamix-wd-mu64",
        fadam.ademamix,
        {"learning_rate": 1e-2, "b3": 0.99, "weight_decay": 1e-3, "mu_dtype": torch.float64},
        reference="equations",
    ),
    Row("yogi", fadam.yogi, {"learning_rate": 1e-2}, reference="equations"),
    Row("adabelief", fadam.adabelief, {"learning_rate": 1e-2}, reference="equations"),
    Row("adabelief-nesterov", fadam.adabelief, {"learning_rate": 1e-2, "nesterov": True}, reference="equations"),
    Row("cautious-adamw", cautious_adamw, {"lr": 1e-2, "weight_decay": 1e-3}, reference="equations"),
    Row("cautious-lion", cautious_lion, {"lr": 1e-2}, reference="equations"),
]
