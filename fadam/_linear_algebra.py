"""optax's linear algebra helpers under their names: ``power_iteration`` (the dominant eigenpair of a matrix or of
a matrix-vector product over pytrees) and ``matrix_inverse_pth_root`` (coupled Newton iterations)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fadam._tree import PyTree, tree_scale, tree_sub
from fadam._tree_math import tree_norm, tree_vdot

__all__ = ["matrix_inverse_pth_root", "power_iteration"]


def _normalized(tree: PyTree) -> PyTree:
    return tree_scale(tree, 1.0 / tree_norm(tree))


def _uniform_start(matrix: torch.Tensor, key: int | torch.Generator | None) -> torch.Tensor:
    """A start vector drawn uniformly in [-1, 1] from ``key`` (a seed, default 0, or a torch.Generator)."""
    generator = key if isinstance(key, torch.Generator) else torch.Generator().manual_seed(0 if key is None else key)
    draw = torch.rand(matrix.shape[-1:], generator=generator, dtype=torch.float64)
    return (2 * draw - 1).to(device=matrix.device, dtype=matrix.dtype)


def power_iteration(
    matrix: torch.Tensor | Callable[[PyTree], PyTree],
    *,
    v0: PyTree | None = None,
    num_iters: int = 100,
    error_tolerance: float = 1e-6,
    precision: Any = None,
    key: int | torch.Generator | None = None,
) -> tuple[torch.Tensor, PyTree]:
    r"""The dominant eigenvalue of a diagonalizable matrix and its eigenvector, by power iteration.

    .. math::
        v_{k+1} = \frac{A v_k}{\|A v_k\|},\quad \lambda_k = v_k^\top A v_k

    until :math:`\|A v_k - \lambda_k v_k\| / |\lambda_k| <` ``error_tolerance`` or after ``num_iters`` products.

    Args:
        matrix: a square matrix, or a function computing the product of a matrix with a pytree of tensors.
        v0: the start vector (a pytree of the function's input for a function, required there); default for a
            matrix: uniform in :math:`[-1, 1]`, drawn by torch from ``key``.
        num_iters: the largest number of products.
        error_tolerance: the relative residual at which the iteration stops.
        precision: JAX's matmul precision, accepted for optax's signature and unused (torch multiplies float32
            and float64 matrices at their precision; TF32 on CUDA follows ``torch.backends``).
        key: the seed (or a ``torch.Generator``) of the default start vector (default 0).

    Returns:
        The eigenvalue (a 0-d tensor) and the unit eigenvector (a pytree like ``v0``).

    Example:
        >>> import torch, fadam
        >>> value, vector = fadam.power_iteration(torch.tensor([[2.0, 0.0], [0.0, 1.0]]), v0=torch.ones(2))
        >>> round(float(value), 4), vector.abs().round(decimals=3)
        (2.0, tensor([1., 0.]))

    References:
        optax's ``optax.power_iteration`` (0.2.8), whose semantics these are.
    """
    del precision
    if callable(matrix):
        if v0 is None:
            raise ValueError("power_iteration: v0 must be given when matrix is a function")
        product = matrix
    else:
        if matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1]:
            raise ValueError(f"power_iteration expects a square matrix, got shape {tuple(matrix.shape)}")
        product = lambda v: matrix @ v  # noqa: E731
        v0 = _uniform_start(matrix, key) if v0 is None else v0
    vector = _normalized(v0)
    image = product(vector)
    value, iterations = torch.zeros_like(tree_norm(vector)), 0  # no estimate yet: the first check fails
    while iterations < num_iters:
        residual = tree_norm(tree_sub(image, tree_scale(vector, value)))
        if bool(torch.abs(residual / value) < error_tolerance):
            break
        vector = _normalized(image)
        image = product(vector)
        value = tree_vdot(vector, image)
        iterations += 1
    return value, _normalized(image)


def matrix_inverse_pth_root(
    matrix: torch.Tensor,
    p: int,
    num_iters: int = 100,
    ridge_epsilon: float = 1e-6,
    error_tolerance: float = 1e-6,
    precision: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``matrix`` to the power :math:`-1/p` (a symmetric positive semi-definite matrix, a positive integer
    :math:`p`), by coupled Newton iterations.

    With :math:`A = M + \epsilon\lambda_{max} I` (:math:`\lambda_{max}` by ``power_iteration``),
    :math:`z = (1+p) / (2\|A\|_F)`, :math:`M_0 = zA`, :math:`H_0 = z^{1/p} I`:

    .. math::
        T_k = \left(1 + \tfrac1p\right) I - \tfrac1p M_k,\quad M_{k+1} = T_k^p M_k,\quad H_{k+1} = H_k T_k

    until :math:`\max|M_k - I| \le` ``error_tolerance``, after ``num_iters``, or once the error grows by more than
    1.2 times (then the previous :math:`H` is returned). A 1x1 matrix is raised to the power directly.

    Args:
        matrix: the square symmetric PSD matrix.
        p: the root, a positive integer.
        num_iters: the largest number of iterations.
        ridge_epsilon: :math:`\epsilon`, relative to the largest eigenvalue (at least 1e-16).
        error_tolerance: the error :math:`\max|M - I|` at which the iteration stops.
        precision: JAX's matmul precision, accepted for optax's signature and unused.

    Returns:
        :math:`M^{-1/p}` in ``matrix``'s dtype, and the error :math:`\max|M_k - I|` (0 for a 1x1 matrix).

    Example:
        >>> import torch, fadam
        >>> root, error = fadam.matrix_inverse_pth_root(torch.diag(torch.tensor([4.0, 16.0])), 2, ridge_epsilon=0.0)
        >>> root.diagonal().round(decimals=4), bool(error < 1e-6)
        (tensor([0.5000, 0.2500]), True)

    References:
        Higham, "Functions of Matrices: Theory and Computation", SIAM 2008, eq. 7.18. optax's
        ``optax.matrix_inverse_pth_root`` (0.2.8), whose iteration this is (optax raises :math:`T_k` to
        :math:`2^{\mathrm{round}(\log_2 p)}`, the same power for p in 1, 2, 4, 8; here it is the p-th for any p).
    """
    del precision
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
        raise ValueError(f"matrix_inverse_pth_root: p must be a positive integer, got {p!r}")
    if matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"matrix_inverse_pth_root expects a square matrix, got shape {tuple(matrix.shape)}")
    alpha = -1.0 / p
    max_eigenvalue, _ = power_iteration(matrix, num_iters=100, error_tolerance=1e-6)
    ridge = ridge_epsilon * torch.clamp(max_eigenvalue, min=1e-16)
    if matrix.shape[0] == 1:
        return (matrix + ridge) ** alpha, torch.zeros([], dtype=matrix.dtype)
    identity = torch.eye(matrix.shape[0], dtype=matrix.dtype, device=matrix.device)
    damped = matrix + ridge * identity
    z = (1 + p) / (2 * torch.linalg.norm(damped))
    mat_m = damped * z
    mat_h = previous_h = identity * z ** (1.0 / p)
    error, improving, iterations = torch.amax(torch.abs(mat_m - identity)), True, 0
    while iterations < num_iters and improving and bool(error > error_tolerance):
        step = (1 - alpha) * identity + alpha * mat_m
        mat_m = torch.linalg.matrix_power(step, p) @ mat_m
        previous_h, mat_h = mat_h, mat_h @ step
        new_error = torch.amax(torch.abs(mat_m - identity))
        improving, error = bool(new_error < error * 1.2), new_error
        iterations += 1
    error = torch.amax(torch.abs(mat_m - identity))
    return (mat_h if improving else previous_h).to(matrix.dtype), error
