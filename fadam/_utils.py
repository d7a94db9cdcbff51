"""optax's utilities under their names: ``scale_gradient`` (identity forward, scaled gradient backward) and
``multi_normal`` (a diagonal Gaussian parameterized by its log scale, for perturbation methods)."""

from __future__ import annotations

from typing import Any

import torch

from fadam._tree import PyTree, tree_map

__all__ = ["MultiNormalDiagFromLogScale", "multi_normal", "scale_gradient"]


class _ScaleGradient(torch.autograd.Function):
    """The identity whose backward multiplies the gradient by a constant."""

    generate_vmap_rule = True  # so that it runs under torch.func (vmap, grad, jacrev)

    @staticmethod
    def forward(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        scale = inputs[1]
        if isinstance(scale, torch.Tensor):
            ctx.save_for_backward(scale)
        else:
            ctx.scale = scale

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        scale = ctx.saved_tensors[0] if ctx.saved_tensors else ctx.scale
        return grad * scale, None


def scale_gradient(inputs: PyTree, scale: float | torch.Tensor) -> PyTree:
    r"""``inputs`` unchanged, with the gradient flowing back through them multiplied by ``scale``.

    .. math::
        y = x,\quad \frac{\partial L}{\partial x} = s\,\frac{\partial L}{\partial y}

    (a scale of 1 returns ``inputs`` as they are, a scale of 0 detached; autograd and ``torch.func`` both see it).

    Args:
        inputs: a pytree of tensors.
        scale: the factor :math:`s` of the gradient (a number or a 0-d tensor, not itself differentiated).

    Example:
        >>> import torch, fadam
        >>> x = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> y = fadam.scale_gradient(x, 0.5)
        >>> torch.autograd.grad((y * y).sum(), x)[0]  # half of 2 x
        tensor([1., 2.])

    References:
        optax's ``optax.scale_gradient`` (0.2.8).
    """
    if not isinstance(scale, torch.Tensor) and scale == 1.0:
        return inputs
    if not isinstance(scale, torch.Tensor) and scale == 0.0:
        return tree_map(lambda x: None if x is None else x.detach(), inputs)
    return tree_map(lambda x: None if x is None else _ScaleGradient.apply(x, scale), inputs)


class MultiNormalDiagFromLogScale:
    """A Gaussian with independent coordinates of mean ``loc`` and standard deviation ``exp(log_scale)``
    (broadcast together), exposing the parameters it was given."""

    def __init__(self, loc: torch.Tensor, log_scale: torch.Tensor) -> None:
        self._mean = torch.as_tensor(loc)
        self._log_scale = torch.as_tensor(log_scale)
        self._scale = torch.exp(self._log_scale)
        self._param_shape = torch.broadcast_shapes(self._mean.shape, self._scale.shape)

    def sample(self, shape: tuple[int, ...], key: int | torch.Generator | None = None) -> torch.Tensor:
        """Draws of shape ``(*shape, *param_shape)``; ``key`` a seed or a ``torch.Generator`` (default: torch's
        global generator). jax's draws cannot be reproduced: the same key gives other numbers than optax's."""
        generator = torch.Generator(self._mean.device).manual_seed(key) if isinstance(key, int) else key
        dtype = torch.promote_types(self._mean.dtype, self._scale.dtype)
        noise = torch.randn((*shape, *self._param_shape), generator=generator, dtype=dtype, device=self._mean.device)
        return noise * self._scale + self._mean

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        """The log density at ``x``, summed over the parameter dims (one value per draw)."""
        log_prob = torch.distributions.Normal(self._mean, self._scale, validate_args=False).log_prob(x)
        if not self._param_shape:  # a scalar distribution: nothing to sum (an empty dim list would sum all)
            return log_prob
        return torch.sum(log_prob, dim=tuple(range(-len(self._param_shape), 0)))

    @property
    def log_scale(self) -> torch.Tensor:
        return self._log_scale

    @property
    def params(self) -> list[torch.Tensor]:
        return [self._mean, self._log_scale]


def multi_normal(loc: torch.Tensor, log_scale: torch.Tensor) -> MultiNormalDiagFromLogScale:
    r"""A diagonal Gaussian :math:`\mathcal N(\mu, \operatorname{diag}(e^{2 s}))` from its mean and log standard
    deviation, with ``sample`` and ``log_prob`` (summed over the parameter dims).

    .. math::
        \log p(x) = \sum_i -\frac{(x_i - \mu_i)^2}{2 e^{2 s_i}} - s_i - \tfrac12\log 2\pi

    Args:
        loc: the mean :math:`\mu`.
        log_scale: the log standard deviation :math:`s` (broadcast against ``loc``).

    Example:
        >>> import torch, fadam
        >>> dist = fadam.multi_normal(torch.zeros(2), torch.zeros(2))
        >>> round(float(dist.log_prob(torch.zeros(2))), 4)  # -log(2 pi)
        -1.8379
        >>> dist.sample((5,), key=0).shape
        torch.Size([5, 2])

    References:
        optax's ``optax.multi_normal`` (0.2.8), whose semantics these are.
    """
    return MultiNormalDiagFromLogScale(loc, log_scale)
