"""fadam: functional optimizers for PyTorch. Transforms are values: ``init(params) -> state`` and
``update(updates, state, params=None) -> (updates, state)``, pure functions over pytrees of tensors."""

import torch

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
from fadam._execute import backend, explain
from fadam._muon_aliases import muon, muon_labels, muon_with_adamw
from fadam._optax_aliases import (
    adan,
    fromage,
    lars,
    noisy_sgd,
    novograd,
    optimistic_adam,
    optimistic_gradient_descent,
    polyak_sgd,
    sm3,
)
from fadam._torch_aliases import adadelta, adafactor_torch, asgd, rprop
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
from fadam.aliases import (
    adabelief,
    adafactor,
    adagrad,
    adam,
    adamax,
    adamw,
    ademamix,
    adopt,
    lamb,
    lion,
    nadam,
    nadamw,
    radam,
    rmsprop,
    sgd,
    sign_sgd,
    signum,
    yogi,
)
from fadam.bridge import Optimizer, state_from_torch, state_to_torch
from fadam.combinators._chain import chain, named_chain
from fadam.combinators._conditionality import (
    ConditionallyMaskState,
    ConditionallyTransformState,
    conditionally_mask,
    conditionally_transform,
)
from fadam.combinators._inject import InjectHyperparamsState, inject_hyperparams
from fadam.combinators._lookahead import LookaheadParams, LookaheadState, lookahead
from fadam.combinators._masking import MaskedNode, MaskedState, PartitionState, masked, partition
from fadam.combinators._multi_transform import multi_transform
from fadam.combinators._sam import SAMState, normalize, sam
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
from fadam.distributed import Sharded, gather, pmap
from fadam.meta import MetaOptimizer, MetaSnapshot, stop_gradient
from fadam.paging import (
    PagedState,
    PagedStateFileError,
    page_state,
    paged_adam,
    paged_adam8bit,
    paged_adamw,
    paged_adamw8bit,
)
from fadam.quantization import QuantizedArray, QuantizedState, quantize_state
from fadam.quantization._aliases import adam4bit, adam8bit, adamw4bit, adamw8bit, ademamix8bit, lion8bit, sgd8bit
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
from fadam.transforms._accumulation import ApplyEvery, apply_every
from fadam.transforms._adadelta import ScaleByAdadeltaState, scale_by_adadelta
from fadam.transforms._adafactor_torch import ScaleByAdafactorTorchState, scale_by_adafactor_torch
from fadam.transforms._adam import ScaleByAdamState, ScaleByAmsgradState, scale_by_adam
from fadam.transforms._adam_variants import (
    ScaleByAdamaxState,
    ScaleByNadamState,
    ScaleByRadamState,
    scale_by_adamax,
    scale_by_nadam,
    scale_by_radam,
)
from fadam.transforms._adan import ScaleByAdanState, scale_by_adan
from fadam.transforms._adaptive_clipping import adaptive_grad_clip, per_example_global_norm_clip
from fadam.transforms._ademamix import ScaleByAdemamixState, scale_by_ademamix
from fadam.transforms._adopt import ScaleByAdoptState, scale_by_adopt
from fadam.transforms._asgd import ScaleByAsgdState, scale_by_asgd
from fadam.transforms._belief import ScaleByBeliefState, scale_by_belief
from fadam.transforms._block_scaling import scale_by_param_block_rms, scale_by_trust_ratio
from fadam.transforms._cautious import cautious
from fadam.transforms._centralize import centralize
from fadam.transforms._clipping import clip, clip_by_block_rms, clip_by_global_norm
from fadam.transforms._constraining import keep_params_nonnegative
from fadam.transforms._decay import add_decayed_weights, add_decoupled_weight_decay
from fadam.transforms._factorized import FactoredState, scale_by_factored_rms
from fadam.transforms._lbfgs import LbfgsState, lbfgs
from fadam.transforms._lion import ScaleByLionState, scale_by_lion
from fadam.transforms._mars import ScaleByMarsState, mars, scale_by_mars
from fadam.transforms._momentum import EmaState, TraceState, ema, trace
from fadam.transforms._muon import ScaleByMuonState, scale_by_muon
from fadam.transforms._noise import AddNoiseState, add_noise
from fadam.transforms._normalizing import normalize_by_update_norm
from fadam.transforms._novograd import ScaleByNovogradState, scale_by_novograd
from fadam.transforms._optimistic import ScaleByOptimisticGradientState, scale_by_optimistic_gradient
from fadam.transforms._polyak import scale_by_polyak
from fadam.transforms._prodigy import ProdigyState, prodigy
from fadam.transforms._rms import (
    ScaleByRmsState,
    ScaleByRssState,
    ScaleByRStdDevState,
    scale_by_rms,
    scale_by_rss,
    scale_by_stddev,
)
from fadam.transforms._rprop import ScaleByRpropState, scale_by_rprop
from fadam.transforms._scaling import ScaleByScheduleState, scale, scale_by_learning_rate, scale_by_schedule
from fadam.transforms._schedule_free import (
    ScaleBySecondMomentState,
    ScheduleFreeState,
    schedule_free,
    schedule_free_adamw,
    schedule_free_eval_params,
    schedule_free_sgd,
)
from fadam.transforms._sign import scale_by_sign
from fadam.transforms._sm3 import ScaleBySM3State, scale_by_sm3
from fadam.transforms._yogi import ScaleByYogiState, scale_by_yogi

global_norm = tree_global_norm

# fadam's state containers hold only tensors and containers: a raw state saved with torch.save loads with
# torch.load(weights_only=True)
torch.serialization.add_safe_globals(
    [
        AddNoiseState,
        ApplyEvery,
        ApplyIfFiniteState,
        ConditionallyMaskState,
        ConditionallyTransformState,
        EmaState,
        EmptyState,
        FactoredState,
        InjectHyperparamsState,
        LbfgsState,
        LookaheadParams,
        LookaheadState,
        MaskedNode,
        MaskedState,
        MultiStepsState,
        PagedState,
        PartitionState,
        ProdigyState,
        QuantizedArray,
        QuantizedState,
        SAMState,
        ScaleByAdadeltaState,
        ScaleByAdafactorTorchState,
        ScaleByAdamState,
        ScaleByAdamaxState,
        ScaleByAdanState,
        ScaleByAdemamixState,
        ScaleByAdoptState,
        ScaleByAmsgradState,
        ScaleByAsgdState,
        ScaleByBeliefState,
        ScaleByLionState,
        ScaleByMarsState,
        ScaleByMuonState,
        ScaleByNadamState,
        ScaleByNovogradState,
        ScaleByOptimisticGradientState,
        ScaleByRStdDevState,
        ScaleByRadamState,
        ScaleByRmsState,
        ScaleByRssState,
        ScaleByRpropState,
        ScaleBySM3State,
        ScaleByScheduleState,
        ScaleBySecondMomentState,
        ScaleByYogiState,
        ScheduleFreeState,
        TraceState,
        ZeroNansState,
    ]
)

__version__ = "0.1.0"

__all__ = [
    "backend",
    "explain",
    "AddNoiseState",
    "ApplyEvery",
    "ApplyIfFiniteState",
    "ConditionallyMaskState",
    "ConditionallyTransformState",
    "EmaState",
    "EmptyState",
    "FactoredState",
    "FusibleUpdate",
    "GradientTransformation",
    "GradientTransformationExtraArgs",
    "InjectHyperparamsState",
    "LbfgsState",
    "LookaheadParams",
    "LookaheadState",
    "MaskedNode",
    "MaskedState",
    "MetaOptimizer",
    "MetaSnapshot",
    "MultiSteps",
    "MultiStepsState",
    "Optimizer",
    "PagedState",
    "PagedStateFileError",
    "PartitionState",
    "ProdigyState",
    "QuantizedArray",
    "QuantizedState",
    "SAMState",
    "ScalarOrSchedule",
    "ScaleByAdadeltaState",
    "ScaleByAdafactorTorchState",
    "ScaleByAdamState",
    "ScaleByAdamaxState",
    "ScaleByAdanState",
    "ScaleByAdemamixState",
    "ScaleByAdoptState",
    "ScaleByAmsgradState",
    "ScaleByAsgdState",
    "ScaleByBeliefState",
    "ScaleByLionState",
    "ScaleByMarsState",
    "ScaleByMuonState",
    "ScaleByNadamState",
    "ScaleByNovogradState",
    "ScaleByOptimisticGradientState",
    "ScaleByRStdDevState",
    "ScaleByRadamState",
    "ScaleByRmsState",
    "ScaleByRssState",
    "ScaleByRpropState",
    "ScaleBySM3State",
    "ScaleByScheduleState",
    "ScaleByYogiState",
    "Schedule",
    "ScheduleFreeState",
    "Sharded",
    "TraceState",
    "ZeroNansState",
    "adabelief",
    "adadelta",
    "adafactor",
    "adafactor_torch",
    "adagrad",
    "adam",
    "adam4bit",
    "adam8bit",
    "adamax",
    "adamw",
    "adamw4bit",
    "adamw8bit",
    "adan",
    "adaptive_grad_clip",
    "add_decayed_weights",
    "add_decoupled_weight_decay",
    "add_noise",
    "ademamix",
    "ademamix8bit",
    "adopt",
    "apply_every",
    "asgd",
    "apply_if_finite",
    "apply_updates",
    "cautious",
    "centralize",
    "chain",
    "clip",
    "clip_by_block_rms",
    "clip_by_global_norm",
    "conditionally_mask",
    "conditionally_transform",
    "constant_schedule",
    "cosine_decay_schedule",
    "cosine_onecycle_schedule",
    "ema",
    "exponential_decay",
    "freeze",
    "fromage",
    "gather",
    "global_norm",
    "identity",
    "inject_hyperparams",
    "join_schedules",
    "keep_params_nonnegative",
    "lamb",
    "lars",
    "lbfgs",
    "linear_onecycle_schedule",
    "linear_schedule",
    "lion",
    "lion8bit",
    "lookahead",
    "masked",
    "mars",
    "multi_transform",
    "muon",
    "muon_labels",
    "muon_with_adamw",
    "nadam",
    "nadamw",
    "named_chain",
    "noisy_sgd",
    "normalize",
    "normalize_by_update_norm",
    "novograd",
    "optimistic_adam",
    "optimistic_gradient_descent",
    "page_state",
    "paged_adam",
    "paged_adam8bit",
    "paged_adamw",
    "paged_adamw8bit",
    "partition",
    "per_example_global_norm_clip",
    "piecewise_constant_schedule",
    "piecewise_interpolate_schedule",
    "pmap",
    "polyak_sgd",
    "polynomial_schedule",
    "prodigy",
    "quantize_state",
    "radam",
    "rmsprop",
    "rprop",
    "sam",
    "scale",
    "scale_by_adadelta",
    "scale_by_adafactor_torch",
    "scale_by_adam",
    "scale_by_adamax",
    "scale_by_adan",
    "scale_by_ademamix",
    "scale_by_adopt",
    "scale_by_asgd",
    "scale_by_belief",
    "scale_by_factored_rms",
    "scale_by_learning_rate",
    "scale_by_lion",
    "scale_by_mars",
    "scale_by_muon",
    "scale_by_nadam",
    "scale_by_novograd",
    "scale_by_optimistic_gradient",
    "scale_by_param_block_rms",
    "scale_by_polyak",
    "scale_by_radam",
    "scale_by_rms",
    "scale_by_rss",
    "scale_by_rprop",
    "scale_by_schedule",
    "scale_by_sign",
    "scale_by_sm3",
    "scale_by_stddev",
    "scale_by_trust_ratio",
    "scale_by_yogi",
    "schedule_free",
    "schedule_free_adamw",
    "schedule_free_eval_params",
    "schedule_free_sgd",
    "schedules",
    "selective_transform",
    "set_to_zero",
    "sgd",
    "sgd8bit",
    "sgdr_schedule",
    "sign_sgd",
    "signum",
    "skip_large_updates",
    "skip_not_finite",
    "sm3",
    "state_from_dict",
    "state_from_torch",
    "state_to_dict",
    "state_to_torch",
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
    "yogi",
    "zero_nans",
]
