"""Meta-learning: differentiable optimizer steps on ``nn.Module``s, snapshots between tasks, truncated backprop.

Every fadam ``update`` builds the autograd graph when its inputs require grad, so an unrolled inner loop is plain code
in the functional style (``torch.func.grad`` + ``torch.func.functional_call``, vmapped over tasks if wanted)::

    def adapt(params, x, y):
        state = tx.init(params)
        for _ in range(steps):
            grads = torch.func.grad(loss_fn)(params, x, y)
            params, state = fadam.step(tx, params, grads, state)
        return params

``MetaOptimizer`` is the module-based style (torchopt's ``MetaAdam``): its ``step(loss)`` replaces the module's
parameters by the updated tensors, which stay in the graph, so a loss computed after several steps backpropagates to
the original parameters and to any hyperparameter tensor the transform closes over.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn
from torch._C import _functorch

from fadam._base import GradientTransformation, add_update, apply_updates
from fadam._tree import PyTree, tree_map

__all__ = ["MetaOptimizer", "MetaSnapshot", "stop_gradient"]


def stop_gradient(tree: PyTree) -> PyTree:
    """Cuts the graph behind every tensor of ``tree``: returns detached tensors (nothing is modified).

    A tensor that required grad is returned as a new leaf that requires grad, so an inner loop can go on computing
    gradients with respect to it; the steps before are no longer differentiated through (truncated backpropagation).
    Inside ``torch.func`` transforms it is ``detach`` leaf by leaf.

    Example:
        >>> import torch, fadam
        >>> w = torch.ones(2, requires_grad=True)
        >>> cut = fadam.stop_gradient({"w": w * 3})
        >>> cut["w"].grad_fn is None, cut["w"].requires_grad
        (True, True)
    """

    def cut(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        detached = x.detach()
        if x.requires_grad and not _functorch.is_functorch_wrapped_tensor(x):  # torch.func tracks by itself
            detached.requires_grad_()
        return detached

    return tree_map(cut, tree)


class MetaSnapshot(NamedTuple):
    """Module parameters, buffers and optimizer state at one moment (see ``MetaOptimizer.snapshot``)."""

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    state: PyTree


class MetaOptimizer:
    r"""Steps an ``nn.Module``'s parameters differentiably with a fadam transform.

    ``step(loss)`` computes the gradients with ``create_graph=True``, runs ``tx.update`` and puts the new parameters
    (non-leaf tensors in the graph) into the module in place of the old ones. After :math:`K` steps a loss on the
    module backpropagates through all of them to the parameters the module had before (MAML's meta-parameters) and to
    hyperparameter tensors the transform uses. Nothing is modified in place: the original ``nn.Parameter`` objects
    keep their values, so ``restore`` of a snapshot taken before the inner loop starts the next task from them.

    Tied parameters (one tensor in several modules) stay tied. Parameters that do not require grad are passed to the
    transform with a ``None`` gradient, which fadam skips.

    Args:
        module: the module whose parameters are stepped.
        tx: the transform, e.g. ``fadam.sgd(lr=0.01)`` or ``fadam.adam(lr=alpha)`` with a tensor ``alpha``.
        truncate: if given, the graph is cut (``stop_gradient`` of parameters and state) after every ``truncate``
            steps: backpropagation runs through the steps since the last cut only (truncated backpropagation).

    Example:
        >>> import torch, fadam
        >>> net = torch.nn.Linear(2, 1)
        >>> meta_params = list(net.parameters())
        >>> opt = fadam.MetaOptimizer(net, fadam.sgd(lr=0.1))
        >>> x = torch.ones(4, 2)
        >>> for _ in range(3):
        ...     opt.step(net(x).pow(2).mean())
        >>> net.weight.grad_fn is not None  # the adapted weight is a function of the meta-parameters
        True
        >>> meta_grads = torch.autograd.grad(net(x).pow(2).mean(), meta_params)

    References:
        Finn et al., "Model-Agnostic Meta-Learning for Fast Adaptation of Deep Networks", 2017.
        Ren et al., "TorchOpt: An Efficient Library for Differentiable Optimization", 2023.
    """

    def __init__(self, module: nn.Module, tx: GradientTransformation, *, truncate: int | None = None) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"MetaOptimizer needs an nn.Module, got {type(module).__name__}")
        if not isinstance(tx, GradientTransformation):
            raise TypeError(f"MetaOptimizer needs a GradientTransformation, got {type(tx).__name__}")
        if truncate is not None and truncate < 1:
            raise ValueError(f"truncate must be a positive number of steps, got {truncate}")
        self.module = module
        self.tx = tx
        self.truncate = truncate
        self.steps = 0
        # every (submodule, attribute) slot of each distinct parameter, so tied parameters are written back together
        self._slots: dict[str, list[tuple[nn.Module, str]]] = {}
        first_name: dict[int, str] = {}
        for module_name, submodule in module.named_modules(remove_duplicate=False):
            for key, param in submodule._parameters.items():
                if param is None:
                    continue
                name = first_name.setdefault(id(param), f"{module_name}.{key}" if module_name else key)
                slots = self._slots.setdefault(name, [])
                if all(owner is not submodule or k != key for owner, k in slots):
                    slots.append((submodule, key))
        self.state = tx.init(self.params())

    def params(self) -> dict[str, torch.Tensor]:
        """The module's current parameters, name to tensor (each tied parameter once, under its first name)."""
        return {name: slots[0][0]._parameters[slots[0][1]] for name, slots in self._slots.items()}

    def _set_params(self, params: dict[str, torch.Tensor]) -> None:
        for name, slots in self._slots.items():
            for owner, key in slots:
                owner._parameters[key] = params[name]  # bypasses nn.Module's Parameter-only __setattr__ check

    def step(self, loss: torch.Tensor) -> None:
        """One differentiable step on ``loss``: the module's parameters become the updated tensors."""
        params = self.params()
        names = [name for name, p in params.items() if p.requires_grad]
        if not names:
            raise ValueError("MetaOptimizer.step: no parameter of the module requires grad")
        # Truncation cuts here, after ``loss`` was computed from the old parameters. Backpropagation that starts at a
        # detached copy of them sees the gradient as a constant, so it is taken without a graph: the result equals a
        # ``stop_gradient()`` called before ``loss`` was computed.
        cut = self.truncate is not None and self.steps > 0 and self.steps % self.truncate == 0
        found = torch.autograd.grad(loss, [params[n] for n in names], create_graph=not cut, allow_unused=True)
        grads: dict[str, torch.Tensor | None] = dict.fromkeys(params)
        grads.update(zip(names, found))
        state = self.state
        if cut:
            params, state = stop_gradient(params), stop_gradient(state)
        updates, self.state = self.tx.update(grads, state, params)
        self._set_params(_add_updates(params, updates))
        self.steps += 1

    def stop_gradient(self) -> None:
        """Cuts the graph behind the module's parameters and the optimizer state (truncated backpropagation)."""
        self._set_params(stop_gradient(self.params()))
        self.state = stop_gradient(self.state)

    def snapshot(self, *, detach: bool = False) -> MetaSnapshot:
        """The current parameters, buffers and optimizer state.

        Parameters and state are held by reference (fadam never modifies them, and the meta-parameters should stay
        the very tensors an outer optimizer updates); buffers are cloned, since modules update them in place (batch
        norm statistics). With ``detach=True`` everything is a detached copy that keeps no graph alive.
        """
        params, state = self.params(), self.state
        if detach:
            params, state = tree_map(_detached_copy, params), tree_map(_detached_copy, state)
        buffers = {name: _detached_copy(b) for name, b in self.module.named_buffers()}
        return MetaSnapshot(params, buffers, state)

    def restore(self, snapshot: MetaSnapshot) -> None:
        """Puts back the parameters, buffers and state of ``snapshot`` (e.g. the meta-parameters before a new task)."""
        if set(snapshot.params) != set(self._slots):
            raise ValueError(
                f"snapshot has parameters {sorted(snapshot.params)} but the module has {sorted(self._slots)}"
            )
        self._set_params(snapshot.params)
        with torch.no_grad():
            for name, buffer in self.module.named_buffers():
                buffer.copy_(snapshot.buffers[name])
        self.state = snapshot.state
        self.steps = 0


def _add_updates(params: dict[str, torch.Tensor], updates: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
    """``apply_updates`` for the flat dict built here (its structure checks are already guaranteed)."""
    if not isinstance(updates, dict) or updates.keys() != params.keys():
        return apply_updates(params, updates)  # a transform that changed the structure: let apply_updates explain
    return {name: p if (u := updates[name]) is None else add_update(p, u) for name, p in params.items()}


def _detached_copy(x: Any) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    return x.detach().clone().requires_grad_(x.requires_grad)
