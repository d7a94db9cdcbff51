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
from fadam.combinators._masking import MaskedNode, MaskedState, PartitionState, masked, partition
from fadam.distributed import Sharded, gather, pmap
from fadam.transforms._adam import ScaleByAdamState, ScaleByAmsgradState, scale_by_adam
from fadam.transforms._clipping import clip, clip_by_global_norm
from fadam.transforms._decay import add_decayed_weights, add_decoupled_weight_decay
from fadam.transforms._momentum import TraceState, trace
from fadam.transforms._scaling import ScaleByScheduleState, scale, scale_by_learning_rate, scale_by_schedule

global_norm = tree_global_norm

__version__ = "0.1.0"

__all__ = [
    "EmptyState",
    "FusibleUpdate",
    "GradientTransformation",
    "GradientTransformationExtraArgs",
    "MaskedNode",
    "MaskedState",
    "PartitionState",
    "ScalarOrSchedule",
    "ScaleByAdamState",
    "ScaleByAmsgradState",
    "ScaleByScheduleState",
    "Schedule",
    "Sharded",
    "TraceState",
    "adam",
    "adamw",
    "add_decayed_weights",
    "add_decoupled_weight_decay",
    "apply_updates",
    "chain",
    "clip",
    "clip_by_global_norm",
    "gather",
    "global_norm",
    "identity",
    "masked",
    "named_chain",
    "partition",
    "pmap",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_schedule",
    "set_to_zero",
    "sgd",
    "state_from_dict",
    "state_to_dict",
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
