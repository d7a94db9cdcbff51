"""fadam: functional optimizers for PyTorch. Transforms are values: ``init(params) -> state`` and
``update(updates, state, params=None) -> (updates, state)``, pure functions over pytrees of tensors."""

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
from fadam.aliases import adafactor, adagrad, adam, adamax, adamw, lamb, lion, nadam, nadamw, radam, rmsprop, sgd
from fadam.bridge import Optimizer, state_from_torch, state_to_torch
from fadam.combinators._chain import chain, named_chain
from fadam.combinators._masking import MaskedNode, MaskedState, PartitionState, masked, partition
from fadam.transforms._adam import ScaleByAdamState, ScaleByAmsgradState, scale_by_adam
from fadam.transforms._adam_variants import (
    ScaleByAdamaxState,
    ScaleByNadamState,
    ScaleByRadamState,
    scale_by_adamax,
    scale_by_nadam,
    scale_by_radam,
)
from fadam.transforms._block_scaling import scale_by_param_block_rms, scale_by_trust_ratio
from fadam.transforms._clipping import clip, clip_by_block_rms, clip_by_global_norm
from fadam.transforms._decay import add_decayed_weights, add_decoupled_weight_decay
from fadam.transforms._factorized import FactoredState, scale_by_factored_rms
from fadam.transforms._lion import ScaleByLionState, scale_by_lion
from fadam.transforms._momentum import EmaState, TraceState, ema, trace
from fadam.transforms._rms import (
    ScaleByRmsState,
    ScaleByRssState,
    ScaleByRStdDevState,
    scale_by_rms,
    scale_by_rss,
    scale_by_stddev,
)
from fadam.transforms._scaling import ScaleByScheduleState, scale, scale_by_learning_rate, scale_by_schedule

global_norm = tree_global_norm

__version__ = "0.1.0"

__all__ = [
    "EmaState",
    "EmptyState",
    "FactoredState",
    "FusibleUpdate",
    "GradientTransformation",
    "GradientTransformationExtraArgs",
    "MaskedNode",
    "Optimizer",
    "MaskedState",
    "PartitionState",
    "ScalarOrSchedule",
    "ScaleByAdamState",
    "ScaleByAdamaxState",
    "ScaleByAmsgradState",
    "ScaleByLionState",
    "ScaleByNadamState",
    "ScaleByRStdDevState",
    "ScaleByRadamState",
    "ScaleByRmsState",
    "ScaleByRssState",
    "ScaleByScheduleState",
    "Schedule",
    "TraceState",
    "adafactor",
    "adagrad",
    "adam",
    "adamax",
    "adamw",
    "add_decayed_weights",
    "add_decoupled_weight_decay",
    "apply_updates",
    "chain",
    "clip",
    "clip_by_block_rms",
    "clip_by_global_norm",
    "ema",
    "global_norm",
    "identity",
    "lamb",
    "lion",
    "masked",
    "nadam",
    "nadamw",
    "named_chain",
    "partition",
    "radam",
    "rmsprop",
    "scale",
    "scale_by_adam",
    "scale_by_adamax",
    "scale_by_factored_rms",
    "scale_by_learning_rate",
    "scale_by_lion",
    "scale_by_nadam",
    "scale_by_param_block_rms",
    "scale_by_radam",
    "scale_by_rms",
    "scale_by_rss",
    "scale_by_schedule",
    "scale_by_stddev",
    "scale_by_trust_ratio",
    "set_to_zero",
    "sgd",
    "state_from_torch",
    "state_to_torch",
    "stateless",
    "stateless_with_tree_map",
    "step",
    "trace",
    "tree_add",
    "tree_cast",
    "tree_global_norm",
    "tree_map",
    "tree_paths",
    "tree_scale",
    "tree_sub",
    "tree_zeros_like",
]
