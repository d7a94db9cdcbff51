"""The table of every optimizer the conformance battery runs over.

Adding an optimizer is one row. Rows for the core aliases live here; other modules add theirs in a file named
``rows_<topic>.py`` beside this one that defines ``ROWS: list[Row]``; every such file is collected below.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import fadam


@dataclass(frozen=True)
class Row:
    name: str
    make: Callable[..., fadam.GradientTransformation]  # make(**kwargs) -> transform; kwargs as in torch_kwargs
    kwargs: dict[str, Any] = field(default_factory=dict)  # hyperparameters for this row (converge on the problems)
    torch_cls: type[torch.optim.Optimizer] | None = None  # reference: the same kwargs give the same trajectory
    complex_params: bool = True  # accepts complex params
    # 'torch' rows are checked against torch_cls; 'equations' rows by their own module's tests
    reference: str = "torch"
    # False for optimizers whose state is a handle to storage outside the tensors (paged state): torch.func's vmap
    # and grad refuse it with a clear error, which the battery checks instead; two inits hold different handles, so
    # batteries compare such a row's params, not its state
    value_state: bool = True
    # False where FSDP2 (DTensor params) is not supported yet: state that is not elementwise in the param (factored
    # second moments, 4-bit codes packed two per byte, paged storage) is not created with the params' placements
    sharded: bool = True
    # hyperparameters that replace some of ``kwargs`` on the convergence problems (test_converges)
    converge_kwargs: dict[str, Any] = field(default_factory=dict)
    # why torch.compile cannot trace a step into one graph, where the design reads the step's decisions on the host
    # (test_compiles_into_one_graph then compiles it with its graph breaks and checks the eager numbers)
    graph_breaks: str | None = None

    def build(self, **overrides: Any) -> fadam.GradientTransformation:
        return self.make(**{**self.kwargs, **overrides})

    def __str__(self) -> str:
        return self.name


CORE_ROWS = [
    Row("adam", fadam.adam, {"lr": 1e-2}, torch.optim.Adam),
    Row("adam-amsgrad-wd", fadam.adam, {"lr": 1e-2, "amsgrad": True, "weight_decay": 0.1}, torch.optim.Adam),
    Row("adam-maximize", fadam.adam, {"lr": 1e-2, "maximize": True, "weight_decay": 0.05}, torch.optim.Adam),
    Row("adamw", fadam.adamw, {"lr": 1e-2}, torch.optim.AdamW),
    Row("adamw-amsgrad", fadam.adamw, {"lr": 1e-2, "amsgrad": True, "weight_decay": 0.1}, torch.optim.AdamW),
    Row("sgd", fadam.sgd, {"lr": 1e-2}, torch.optim.SGD),
    Row("sgd-momentum", fadam.sgd, {"lr": 1e-2, "momentum": 0.9}, torch.optim.SGD),
    Row(
        "sgd-nesterov-wd",
        fadam.sgd,
        {"lr": 1e-2, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
        torch.optim.SGD,
    ),
    Row(
        "sgd-dampening-max",
        fadam.sgd,
        {"lr": 1e-2, "momentum": 0.8, "dampening": 0.3, "maximize": True},
        torch.optim.SGD,
    ),
]


def _collect() -> list[Row]:
    rows = list(CORE_ROWS)
    package = importlib.import_module(__package__)
    for module in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if module.name.startswith("rows_"):
            rows.extend(importlib.import_module(f"{__package__}.{module.name}").ROWS)
    return rows


ALL_ROWS: list[Row] = _collect()
VALUE_ROWS: list[Row] = [row for row in ALL_ROWS if row.value_state]  # state is a value: vmap, pmap, grad apply
