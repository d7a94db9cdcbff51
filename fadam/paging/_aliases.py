"""Paged versions of the torch.optim-style aliases: the optimizer state stays in host memory or on disk.

Each is ``paged(alias)``: the alias's own arguments, plus ``storage``, ``path``, ``chunk_bytes``, ``resume`` and
``durable`` (keyword-only), building ``page_state(alias(...), ..., per_leaf=True)``. Paging another per-leaf alias is
one line, as ``paged_adamw8bit = paged(adamw8bit)`` below, plus its export in ``fadam/__init__.py``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from fadam._base import GradientTransformation
from fadam.aliases import adam, adamw, ademamix
from fadam.paging._wrapper import page_state
from fadam.quantization._aliases import adam8bit, adamw8bit, ademamix8bit

_PAGING_PARAMETERS = [
    inspect.Parameter("storage", inspect.Parameter.KEYWORD_ONLY, default="host"),
    inspect.Parameter("path", inspect.Parameter.KEYWORD_ONLY, default=None),
    inspect.Parameter("chunk_bytes", inspect.Parameter.KEYWORD_ONLY, default=None),
    inspect.Parameter("resume", inspect.Parameter.KEYWORD_ONLY, default=False),
    inspect.Parameter("durable", inspect.Parameter.KEYWORD_ONLY, default=False),
]


def paged(alias: Callable[..., GradientTransformation]) -> Callable[..., GradientTransformation]:
    """The paged version of an alias whose update treats each param leaf on its own (``page_state(per_leaf=True)``).

    Example:
        >>> import torch, fadam
        >>> paged_sgd = fadam.paging.paged(fadam.sgd)
        >>> tx = paged_sgd(lr=0.1, momentum=0.9, chunk_bytes=1 << 20)
        >>> params = [torch.ones(2)]
        >>> fadam.step(tx, params, [torch.ones(2)], tx.init(params))[0]
        [tensor([0.9000, 0.9000])]
    """
    name = f"paged_{alias.__name__}"

    def make(
        *args: Any,
        storage: str = "host",
        path: Any = None,
        chunk_bytes: int | None = None,
        resume: bool = False,
        durable: bool = False,
        **kwargs: Any,
    ) -> GradientTransformation:
        inner = alias(*args, **kwargs)
        return page_state(inner, storage, path, chunk_bytes, per_leaf=True, resume=resume, durable=durable)

    signature = inspect.signature(alias)
    own = [p for p in signature.parameters.values() if p.kind != inspect.Parameter.VAR_KEYWORD]
    make.__signature__ = signature.replace(parameters=own + _PAGING_PARAMETERS)  # type: ignore[attr-defined]
    make.__name__ = make.__qualname__ = name
    make.__module__ = __name__
    make.__doc__ = f"""``fadam.{alias.__name__}`` with its state paged: ``page_state({alias.__name__}(...), storage,
    path, chunk_bytes, per_leaf=True, resume=resume, durable=durable)``.

    Its numbers are ``fadam.{alias.__name__}``'s: ``fadam.step`` runs its fastest backend chunk by chunk, in host
    memory the one the unpaged step takes, on disk the generated kernel, whose numbers are the eager path's (torch's
    fused kernels cannot write the new state into the file's other copy). See ``page_state`` for the storages,
    chunks and checkpoints.

    Example:
        >>> import torch, fadam
        >>> params, grads = {{"w": torch.tensor([1.0, -1.0])}}, {{"w": torch.tensor([0.5, -0.5])}}
        >>> tx, reference = fadam.{name}(0.1, storage="disk"), fadam.{alias.__name__}(0.1)
        >>> paged_params, _ = fadam.step(tx, params, grads, tx.init(params))
        >>> updates, _ = reference.update(grads, reference.init(params), params)
        >>> torch.equal(paged_params["w"], fadam.apply_updates(params, updates)["w"])
        True
    """
    return make


paged_adam = paged(adam)
paged_adamw = paged(adamw)
paged_adam8bit = paged(adam8bit)  # bitsandbytes' PagedAdam8bit, on any device
paged_adamw8bit = paged(adamw8bit)
paged_ademamix = paged(ademamix)  # bitsandbytes' PagedAdEMAMix
paged_ademamix8bit = paged(ademamix8bit)  # and PagedAdEMAMix8bit
