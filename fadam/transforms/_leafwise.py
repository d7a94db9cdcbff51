"""The per-leaf loop shared by moment-based transforms: ``None`` gradients and complex leaves handled in one place."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fadam._dispatch import real_view


def map_moments(
    fn: Callable[..., Sequence[torch.Tensor]],
    grads: Sequence[torch.Tensor | None],
    *moments: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], list[list[torch.Tensor]]]:
    """Runs ``fn(g, *moments) -> (update, *new_moments)`` leaf by leaf and returns the updates and each moment list.

    A ``None`` gradient skips its leaf (update ``None``, moments unchanged), as torch.optim skips a param without a
    gradient. Complex leaves are passed to ``fn`` as ``torch.view_as_real`` views and the results turned back into
    complex tensors, so every statistic is kept per real and imaginary component, exactly as torch.optim does.
    """
    updates: list[torch.Tensor | None] = []
    new_moments: list[list[torch.Tensor]] = [[] for _ in moments]
    for index, g in enumerate(grads):
        leaves = [m[index] for m in moments]
        if g is None:
            updates.append(None)
            for out, leaf in zip(new_moments, leaves):
                out.append(leaf)
            continue
        u, *new = fn(real_view(g), *[real_view(leaf) for leaf in leaves])
        if g.is_complex():
            u = torch.view_as_complex(u.contiguous()) if not u.is_complex() else u
            new = [torch.view_as_complex(n.contiguous()) if leaf.is_complex() else n for n, leaf in zip(new, leaves)]
        updates.append(u.to(g.dtype))
        for out, n in zip(new_moments, new):
            out.append(n)
    return updates, new_moments
