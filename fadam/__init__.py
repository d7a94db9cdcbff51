"""fadam: functional optimizers for PyTorch. Transforms are values: ``init(params) -> state`` and
``update(updates, state, params=None) -> (updates, state)``, pure functions over pytrees of tensors."""

from fadam import schedules
from fadam._base import (
    EmptyState,
    FusibleUpdate,
    GradientTransformation,
    GradientTransformationExtraArgs,
    ScalarOrSchedule,
    Schedule,
    apply_updates,
    identity,
    set_to_zero,
    stateless,
    stateless_with_tree_map,
    step,
)
from fadam._checkpoint import state_from_dict, state_to_dict
from fadam._tree import (
    tree_add,
    tree_cast,
    tree_global_norm,
    tree_map,
    tree_paths,
    tree_scale,
    tree_sub,
    tree_zeros_like,
)
from fadam.aliases import adam, adamw, sgd
from fadam.combinators._chain import chain, named_chain
from fadam.combinators._inject import InjectHyperparamsState, inject_hyperparams
from fadam.combinators._masking import MaskedNode, MaskedState, PartitionState, masked, partition
from fadam.meta import MetaOptimizer, MetaSnapshot, stop_gradient
from fadam.combinators._wrappers import (
    ApplyIfFiniteState,
    MultiSteps,
    MultiStepsState,
    ZeroNansState,
    apply_if_finite,
    freeze,
    selective_transform,
    skip_large_updates,
    skip_not_finite,
    zero_nans,
)
from fadam.schedules import (
    constant_schedule,
    cosine_decay_schedule,
    cosine_onecycle_schedule,
    exponential_decay,
    join_schedules,
    linear_onecycle_schedule,
    linear_schedule,
    piecewise_constant_schedule,
    piecewise_interpolate_schedule,
    polynomial_schedule,
    sgdr_schedule,
    warmup_constant_schedule,
    warmup_cosine_decay_schedule,
    warmup_exponential_decay_schedule,
)
from fadam.transforms._adam import ScaleByAdamState, ScaleByAmsgradState, scale_by_adam
from fadam.transforms._clipping import clip, clip_by_global_norm
from fadam.transforms._decay import add_decayed_weights, add_decoupled_weight_decay
from fadam.transforms._momentum import TraceState, trace
from fadam.transforms._scaling import ScaleByScheduleState, scale, scale_by_learning_rate, scale_by_schedule

global_norm = tree_global_norm

__version__ = "0.1.0"

__all__ = [
    "ApplyIfFiniteState",
    "EmptyState",
    "FusibleUpdate",
    "GradientTransformation",
    "GradientTransformationExtraArgs",
    "InjectHyperparamsState",
    "MaskedNode",
    "MaskedState",
    "MetaOptimizer",
    "MetaSnapshot",
    "MultiSteps",
    "MultiStepsState",
    "PartitionState",
    "ScalarOrSchedule",
    "ScaleByAdamState",
    "ScaleByAmsgradState",
    "ScaleByScheduleState",
    "Schedule",
    "TraceState",
    "ZeroNansState",
    "adam",
    "adamw",
    "add_decayed_weights",
    "add_decoupled_weight_decay",
    "apply_if_finite",
    "apply_updates",
    "chain",
    "clip",
    "clip_by_global_norm",
    "constant_schedule",
    "cosine_decay_schedule",
    "cosine_onecycle_schedule",
    "exponential_decay",
    "freeze",
    "global_norm",
    "identity",
    "inject_hyperparams",
    "join_schedules",
    "linear_onecycle_schedule",
    "linear_schedule",
    "masked",
    "named_chain",
    "partition",
    "piecewise_constant_schedule",
    "piecewise_interpolate_schedule",
    "polynomial_schedule",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_schedule",
    "schedules",
    "selective_transform",
    "set_to_zero",
    "sgd",
    "sgdr_schedule",
    "skip_large_updates",
    "skip_not_finite",
    "state_from_dict",
    "state_to_dict",
    "stateless",
    "stateless_with_tree_map",
    "step",
    "stop_gradient",
    "trace",
    "tree_add",
    "tree_cast",
    "tree_global_norm",
    "tree_map",
    "tree_paths",
    "tree_scale",
    "tree_sub",
    "tree_zeros_like",
    "warmup_constant_schedule",
    "warmup_cosine_decay_schedule",
    "warmup_exponential_decay_schedule",
    "zero_nans",
]
