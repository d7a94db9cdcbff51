"""Muon as torch.optim.Muon (``muon``), and the usual recipe: Muon for the hidden weight matrices, AdamW for every
other param (``muon_with_adamw``)."""

from __future__ import annotations

from collections.abc import Callable

import optree
import torch

from fadam._base import GradientTransformation, ScalarOrSchedule
from fadam._tree import PyTree, path_str
from fadam.aliases import _check_lr, _has_decay, _value, adamw
from fadam.combinators._chain import chain
from fadam.combinators._masking import partition
from fadam.transforms._decay import add_decoupled_weight_decay
from fadam.transforms._muon import NS_COEFFICIENTS, NS_EPS, NS_STEPS, scale_by_muon
from fadam.transforms._scaling import scale_by_learning_rate

AdamWFor = Callable[[str, torch.Tensor], bool]


def muon(
    lr: ScalarOrSchedule = 1e-3,
    weight_decay: float | torch.Tensor = 0.1,
    momentum: float | torch.Tensor = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = NS_EPS,
    ns_steps: int = NS_STEPS,
    adjust_lr_fn: str | None = None,
) -> GradientTransformation:
    r"""Muon exactly as ``torch.optim.Muon``: orthogonalised momentum for 2-D params, decoupled weight decay.

    .. math::
        p_t = (1 - \eta_t\lambda)\, p_{t-1} - \eta_t\, s(A, B)\ \mathrm{NS}_k^{(a,b,c)}(\tilde m_t)

    with :math:`\tilde m_t` the (Nesterov) momentum and :math:`s(A, B)` the shape factor of ``scale_by_muon``.
    ``chain(scale_by_muon, scale_by_learning_rate(lr), add_decoupled_weight_decay(lr, weight_decay))``; the decay
    uses the lr before the shape factor, as torch's does. Every param must be a real 2-D matrix (``init`` raises
    naming the path of one that is not): use ``muon_with_adamw`` for a whole model. DTensor (FSDP2) params: see
    ``scale_by_muon``.

    Args:
        lr: learning rate: a float, a 0-d tensor or a schedule.
        weight_decay: decoupled weight decay :math:`\lambda` (default 0.1, as torch.optim.Muon).
        momentum: the momentum :math:`\mu`.
        nesterov: Nesterov momentum.
        ns_coefficients: the Newton-Schulz quintic's coefficients :math:`(a, b, c)`.
        eps: lower bound on the norm the momentum is divided by before the iteration.
        ns_steps: number of Newton-Schulz iterations.
        adjust_lr_fn: ``None`` or ``"original"`` (:math:`s = \sqrt{\max(1, A/B)}`), or ``"match_rms_adamw"``
            (:math:`s = 0.2\sqrt{\max(A, B)}`, so that AdamW's lr and decay carry over).

    Example:
        >>> import torch, fadam
        >>> tx = fadam.muon(lr=0.1, weight_decay=0.0)
        >>> params = {"w": torch.zeros(2, 2)}
        >>> updates, _ = tx.update({"w": torch.eye(2)}, tx.init(params), params)
        >>> updates["w"]
        tensor([[-0.1125, -0.0000],
                [-0.0000, -0.1125]])

    References:
        Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024 (blog post).
        Liu et al., "Muon is Scalable for LLM Training", 2025.
    """
    _check_lr(lr)
    if not _value(weight_decay, "weight_decay") >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    decay = [add_decoupled_weight_decay(lr, weight_decay)] if _has_decay(weight_decay) else []
    return chain(
        scale_by_muon(momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn),
        scale_by_learning_rate(lr),
        *decay,
    )


def muon_labels(params: PyTree, adamw_for: AdamWFor | None = None) -> PyTree:
    """``"muon"`` for each real 2-D leaf of ``params`` that ``adamw_for(path, leaf)`` does not claim, ``"adamw"``
    for every other leaf: the labels ``muon_with_adamw`` partitions by (paths as ``fadam.tree_paths`` writes them)."""

    def label(path: tuple, leaf: torch.Tensor | None) -> str:
        matrix = isinstance(leaf, torch.Tensor) and leaf.dim() == 2 and not leaf.is_complex()
        return "muon" if matrix and not (adamw_for is not None and adamw_for(path_str(path), leaf)) else "adamw"

    return optree.tree_map_with_path(label, params, none_is_leaf=True)


def muon_with_adamw(
    lr: ScalarOrSchedule = 1e-3,
    weight_decay: float | torch.Tensor = 0.1,
    momentum: float | torch.Tensor = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = NS_EPS,
    ns_steps: int = NS_STEPS,
    adjust_lr_fn: str | None = None,
    *,
    adamw_lr: ScalarOrSchedule = 1e-3,
    adamw_betas: tuple[float, float] = (0.9, 0.999),
    adamw_eps: float = 1e-8,
    adamw_weight_decay: float | torch.Tensor = 1e-2,
    adamw_for: AdamWFor | None = None,
) -> GradientTransformation:
    r"""Muon for the hidden weight matrices, AdamW for every other param: the usual way to train a model with Muon.

    .. math::
        p_t = \begin{cases} (1 - \eta_t\lambda)\, p_{t-1} - \eta_t\, s(A, B)\ \mathrm{NS}_k(\tilde m_t)
        & p \text{ a 2-D matrix not claimed by } \texttt{adamw\_for} \\
        p_t^{\mathrm{AdamW}(\eta^{\mathrm{adamw}}_t,\ \beta,\ \epsilon^{\mathrm{adamw}},\ \lambda^{\mathrm{adamw}})}
        & \text{otherwise (biases, norms, embeddings, output heads)} \end{cases}

    ``partition({"muon": muon(...), "adamw": adamw(...)}, labels)`` with the labels of ``muon_labels``: a leaf
    takes Muon when it is a real 2-D tensor and ``adamw_for(path, param)`` is false. Embeddings and output heads
    are 2-D but belong to AdamW (Jordan et al.; Liu et al.): name them with ``adamw_for``, a predicate on the leaf's
    path as ``fadam.tree_paths`` writes it (``"['embed.weight']"`` for a dict of named params) and the param.
    Jordan's recipe gives AdamW its own lr (``adamw_lr=3e-4``, ``lr=0.02``); Moonlight's
    (``adjust_lr_fn="match_rms_adamw"``) scales Muon's update to AdamW's RMS and uses one lr and one decay for both.
    Moments of both live sharded with DTensor (FSDP2) params; the orthogonalisation gathers each matrix (see
    ``scale_by_muon``).

    Args:
        lr: Muon's learning rate: a float, a 0-d tensor or a schedule.
        weight_decay: Muon's decoupled weight decay.
        momentum: Muon's momentum.
        nesterov: Nesterov momentum for Muon.
        ns_coefficients: the Newton-Schulz quintic's coefficients.
        eps: lower bound on the norm before the iteration.
        ns_steps: number of Newton-Schulz iterations.
        adjust_lr_fn: Muon's shape factor (``None``/``"original"`` or ``"match_rms_adamw"``).
        adamw_lr: AdamW's learning rate: a float, a 0-d tensor or a schedule.
        adamw_betas: AdamW's moment decays.
        adamw_eps: AdamW's epsilon.
        adamw_weight_decay: AdamW's decoupled weight decay.
        adamw_for: ``(path, param) -> bool``: 2-D params that take AdamW (``None``: every other 2-D param takes Muon).

    Example:
        >>> import torch, fadam
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(
        ...     torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 16)
        ... )
        >>> params = {k: v.detach() for k, v in model.named_parameters()}
        >>> head_or_embedding = lambda path, p: path in ("['0.weight']", "['3.weight']")
        >>> tx = fadam.muon_with_adamw(lr=0.02, adamw_lr=3e-4, adamw_for=head_or_embedding)
        >>> [path for path, label in fadam.muon_labels(params, head_or_embedding).items() if label == "muon"]
        ['1.weight']
        >>> grads = {k: torch.randn_like(v) for k, v in params.items()}
        >>> new, state = fadam.step(tx, params, grads, tx.init(params))
        >>> step = {k: params[k] - new[k] for k in params}
        >>> torch.linalg.svdvals(step["1.weight"] - 0.02 * 0.1 * params["1.weight"]) / 0.02  # orthogonalised
        tensor([1.1172, 1.0555, 0.8523, 0.8285, 0.8135, 0.7511, 0.7281, 0.7069])
        >>> step["3.weight"].abs().max()  # AdamW's first step: about its lr per element
        tensor(0.0003)

    References:
        Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024 (blog post).
        Liu et al., "Muon is Scalable for LLM Training", 2025.
    """
    return partition(
        {
            "muon": muon(lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn),
            "adamw": adamw(adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay),
        },
        lambda params: muon_labels(params, adamw_for),
    )
