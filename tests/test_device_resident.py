"""``fadam.capturable``: step counts on the params' device, steps that read nothing on the host, donated steps written
in place, shown on the CPU (no GPU here or on CI; ``benchmarks/gpu.py`` checks syncs and CUDA-graph replays on one).

- no host reads: on the meta device, where any read of a value raises, every chain steps (its new state laid out as
  the CPU run's); on the CPU, a ``TorchFunctionMode`` that fails on ``item``/``tolist``/``bool``/``float``/``int``
  sees no read at all on the eager path (but of ``inject_hyperparams``' numbers, which stay on the host) and no read
  of a count on the others;
- the numbers: those of the same chain with its counts on the CPU, bit for bit, on every CPU backend;
- in place: a donated ``fadam.step`` and ``fadam.Optimizer(capturable=True).step()`` keep every param and state
  tensor in its storage, counts included, so that a CUDA graph replays them;
- the Triton kernel (in Triton's interpreter): its scalars as a device tensor, its pointer table reused across
  donated steps, the numbers of host scalars.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
from torch.overrides import TorchFunctionMode

import fadam

CHAINS: dict[str, Callable[[], fadam.GradientTransformation]] = {
    "adamw": lambda: fadam.adamw(1e-2, weight_decay=0.1),
    "clip+adamw": lambda: fadam.chain(fadam.clip_by_global_norm(1.0), fadam.adamw(1e-2, weight_decay=0.1)),
    "optax chain with a schedule": lambda: fadam.chain(
        fadam.scale_by_adam(),
        fadam.add_decayed_weights(1e-2),
        fadam.scale_by_learning_rate(fadam.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)),
    ),
    "lion": lambda: fadam.lion(1e-3),
    "inject_hyperparams(adam)": lambda: fadam.inject_hyperparams(fadam.adam)(lr=1e-2, betas=(0.8, 0.9)),
    "inject_hyperparams(adam, schedule)": lambda: fadam.inject_hyperparams(fadam.adam)(
        lr=fadam.linear_schedule(1e-2, 1e-3, 3), weight_decay=0.1
    ),
    "MultiSteps(adamw)": lambda: fadam.MultiSteps(fadam.adamw(1e-2), 2).gradient_transformation(),
    "apply_if_finite(adamw)": lambda: fadam.apply_if_finite(fadam.adamw(1e-2), 2),
    "partition(adamw, sgd)": lambda: fadam.partition(
        {"decay": fadam.adamw(1e-2, weight_decay=0.1), "plain": fadam.sgd(1e-2)},
        {"w": "decay", "b": "plain", "s": "plain"},
    ),
    "sgd(momentum)": lambda: fadam.sgd(1e-2, momentum=0.9, nesterov=True),
    "adafactor": lambda: fadam.adafactor(1e-2, min_dim_size_to_factor=2),  # per-leaf statistics and spreads
    "adafactor_torch": lambda: fadam.adafactor_torch(1e-2, weight_decay=0.1),  # two stages on one state
}
STEPS = 4
SKIPS = {"apply_if_finite(adamw)"}  # given a gradient that is not finite
# where the plain step reads a decision (skip, accumulate) or SGD's first-step flag on the host to take torch's fused
# kernel, the capturable one runs the generated kernel: the numbers of the plain step on that backend
CAPTURABLE_AUTO = {"MultiSteps(adamw)": "kernel", "apply_if_finite(adamw)": "kernel", "sgd(momentum)": "kernel"}
_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__}


def _params(device: str = "cpu") -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(6, 5, generator=gen), "b": torch.randn(5, generator=gen)}
    params["s"] = torch.tensor(0.5)  # a 0-d leaf: its scalars are 0-d float64 tensors, its step eager
    return {k: v.to(device) for k, v in params.items()}


def _grads(device: str = "cpu", finite: bool = True) -> list[dict[str, torch.Tensor]]:
    """A gradient per step; without ``finite``, the second one holds an infinity (apply_if_finite skips that step)."""
    gen = torch.Generator().manual_seed(1)
    found = []
    for step in range(STEPS):
        grads = {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in _params().items()}
        if step == 1 and not finite:
            grads["b"][2] = float("inf")
        found.append({k: v.to(device) for k, v in grads.items()})
    return found


def _run(name: str, capturable: bool, backend: str, donate: bool = False) -> tuple[Any, Any]:
    tx = CHAINS[name]()
    tx = fadam.capturable(tx) if capturable else tx
    params = _params()
    state = tx.init(params)
    with fadam.backend(backend):
        for grads in _grads(finite=name not in SKIPS):
            params, state = fadam.step(tx, params, grads, state, donate=donate)
    return params, state


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [leaf for leaf in optree.tree_leaves(tree, none_is_leaf=True) if isinstance(leaf, torch.Tensor)]


def _counts(state: Any) -> list[torch.Tensor]:
    """The state's step counts and counters: its 0-d integer tensors."""
    return [t for t in _tensors(state) if t.dim() == 0 and not t.is_floating_point() and t.dtype != torch.bool]


def _host_numbers(state: Any) -> list[torch.Tensor]:
    """inject_hyperparams' numbers: the factory reads them on the host, where they stay."""
    found: list[torch.Tensor] = []

    def visit(node: Any) -> None:
        if isinstance(node, fadam.InjectHyperparamsState):
            found.extend(node.hyperparams.values())

    optree.tree_map(visit, state, is_leaf=lambda node: isinstance(node, fadam.InjectHyperparamsState))
    return found


class _NoHostReads(TorchFunctionMode):
    """Fails on a host read (``item``, ``tolist``, ``bool``, ``float``, ``int``) of any tensor but ``allowed``, or
    with ``watched``, of those tensors only."""

    def __init__(self, watched: list[torch.Tensor] | None = None, allowed: list[torch.Tensor] = ()) -> None:
        super().__init__()
        self.watched, self.allowed = watched, allowed

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in _READS:
            tensor = args[0]
            read = any(tensor is t for t in self.watched) if self.watched is not None else True
            if read and not any(tensor is t or tensor._base is t for t in self.allowed):  # betas: views of one
                raise AssertionError(f"{func.__name__} of a {tuple(tensor.shape)} {tensor.dtype} tensor in a step")
        return func(*args, **(kwargs or {}))


# ------------------------------------------------------------------------------------------------- no host reads


@pytest.mark.parametrize("name", CHAINS)
def test_on_the_meta_device_a_step_reads_nothing_and_lays_out_the_cpu_runs_state(name):
    tx = fadam.capturable(CHAINS[name]())
    params, grads = _params("meta"), _grads("meta", finite=name not in SKIPS)
    state = tx.init(params)
    assert _counts(state) and all(t.is_meta for t in _counts(state))  # on the params' device
    cpu_params, cpu_state = _run(name, capturable=False, backend="eager")
    like = [(t.shape, t.dtype) for t in _tensors((cpu_params, cpu_state))]
    for backend in ("eager", "auto"):  # the update and apply, and capturable's own step
        new_params, new_state = params, state
        with fadam.backend(backend):
            for g in grads:
                new_params, new_state = fadam.step(tx, new_params, g, new_state, donate=True)
        assert optree.tree_structure(new_state) == optree.tree_structure(cpu_state)
        assert [(t.shape, t.dtype) for t in _tensors((new_params, new_state))] == like
        host = _host_numbers(new_state)
        assert all(t.is_meta for t in _tensors((new_params, new_state)) if not any(t is h for h in host))


@pytest.mark.parametrize("name", CHAINS)
def test_on_the_cpu_a_step_reads_no_count_and_on_the_eager_path_nothing(name):
    tx = fadam.capturable(CHAINS[name]())
    params = _params()
    state = tx.init(params)
    for backend in ("eager", "auto", "kernel"):
        with fadam.backend(backend):
            for g in _grads(finite=name not in SKIPS):
                watched = None if backend == "eager" else _counts(state)
                with _NoHostReads(watched, allowed=_host_numbers(state)):
                    params, state = fadam.step(tx, params, g, state, donate=True)


def test_the_read_check_fails_on_a_step_that_reads_its_count():
    """With counts on the CPU, outside capturable, a step reads its count as a number (the CPU's fast path)."""
    tx = fadam.adamw(1e-2)
    params = _params()
    state = tx.init(params)
    with fadam.backend("eager"), pytest.raises(AssertionError, match="item of a"), _NoHostReads(_counts(state)):
        fadam.step(tx, params, _grads()[0], state)


# ------------------------------------------------------------------------------------------------------ numbers


@pytest.mark.parametrize("name", CHAINS)
def test_device_resident_state_gives_the_numbers_of_cpu_counts(name):
    for backend in ("eager", "auto", "kernel"):
        reference = CAPTURABLE_AUTO.get(name, backend) if backend == "auto" else backend
        expected = _tensors(_run(name, capturable=False, backend=reference))
        found = _tensors(_run(name, capturable=True, backend=backend, donate=True))
        assert len(found) == len(expected)
        for a, b in zip(found, expected):
            assert torch.equal(a, b), (backend, a, b)


# ----------------------------------------------------------------------------------------------------- in place


def _places(tree: Any) -> list[tuple[int, int]]:
    return [(id(t), t.data_ptr()) for t in _tensors(tree)]


@pytest.mark.parametrize("name", CHAINS)
def test_a_donated_step_keeps_every_param_and_state_tensor_in_its_storage(name):
    tx = fadam.capturable(CHAINS[name]())
    params = _params()
    state = tx.init(params)
    places, counts = _places((params, state)), _counts(state)
    for g in _grads(finite=name not in SKIPS):
        params, state = fadam.step(tx, params, g, state, donate=True)
        assert _places((params, state)) == places
    assert sum(int(c) for c in counts) > 0  # incremented where they are
    plain = _run(name, capturable=False, backend="auto")[1]
    assert [int(c) for c in counts] == [int(c) for c in _counts(plain)]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1)).double()


def _optimizer_run(capturable: bool, **flags: Any) -> tuple[torch.nn.Module, fadam.Optimizer, list]:
    model = _model()
    # a float64 tensor lr reads as the number in every kernel: the numbers of a float lr
    lr = torch.tensor(0.01, dtype=torch.float64) if capturable else 0.01
    opt = fadam.Optimizer(model.parameters(), fadam.adamw, lr=lr, weight_decay=0.1, capturable=capturable, **flags)
    places = []
    gen = torch.Generator().manual_seed(2)
    for _ in range(STEPS):
        x = torch.randn(8, 4, generator=gen, dtype=torch.float64)
        model.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        places.append(([p.data_ptr() for p in model.parameters()], _places(opt.tx_states)))
    return model, opt, places


@pytest.mark.parametrize("flags", [{}, {"foreach": False}], ids=["fused kernel", "eager"])
def test_optimizer_capturable_steps_in_place_with_the_numbers_of_a_plain_one(flags):
    model, opt, places = _optimizer_run(capturable=True, **flags)
    assert all(found == places[0] for found in places)
    assert int(opt.tx_states[0][0].count) == STEPS
    plain, _, _ = _optimizer_run(capturable=False, **flags)
    for a, b in zip(model.parameters(), plain.parameters()):
        assert torch.equal(a, b)


def test_optimizer_capturable_refuses_params_off_torchs_capturable_devices():
    w = torch.nn.Parameter(torch.ones(2, device="meta"))
    with pytest.raises(ValueError, match=r"params and state_steps must be on supported devices: \['cpu', 'cuda'"):
        fadam.Optimizer([w], fadam.adam, lr=0.1, capturable=True)


def test_capturable_refuses_what_is_not_a_transform():
    with pytest.raises(TypeError, match="capturable expects a GradientTransformation, got function"):
        fadam.capturable(fadam.adamw)


# ------------------------------------------------------------------------------------------------------- Triton


@pytest.fixture
def _interpreted(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Any:
    """Triton's interpreter for the kernels, written to a temporary folder (``tests/test_triton_kernel.py``'s setup)."""
    pytest.importorskip("triton")
    from fadam import _triton_kernel

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("FADAM_CACHE_DIR", str(tmp_path))
    _triton_kernel._load.cache_clear()
    yield _triton_kernel
    _triton_kernel._load.cache_clear()


TRITON_CHAINS = {"clip+adamw": CHAINS["clip+adamw"], "lamb": lambda: fadam.lamb(1e-2, weight_decay=0.1)}


@pytest.mark.parametrize("name", TRITON_CHAINS)
def test_the_triton_kernel_takes_device_scalars_and_reuses_its_table(name, _interpreted, monkeypatch):
    """clip+adamw is one segment, whose donated steps keep their pointers; lamb's trust ratios are per-leaf scalars,
    in a second segment (which reads the first one's new updates)."""
    kernel_type = _interpreted.TritonKernel
    calls: list[tuple[type, type]] = []
    tables: list[torch.Tensor] = []
    run, table = kernel_type.run, kernel_type._table

    def spy_run(self: Any, leaves: Any, scalars: Any, leaf_scalars: Any) -> None:
        calls.append((type(scalars), type(leaf_scalars)))
        run(self, leaves, scalars, leaf_scalars)

    def spy_table(self: Any, *args: Any) -> torch.Tensor:
        tables.append(table(self, *args))
        return tables[-1]

    monkeypatch.setattr(kernel_type, "run", spy_run)
    monkeypatch.setattr(kernel_type, "_table", spy_table)
    results = {}
    for capturable in (False, True):
        tx = fadam.capturable(TRITON_CHAINS[name]()) if capturable else TRITON_CHAINS[name]()
        params = {k: v for k, v in _params().items() if k != "s"}  # Triton's kernel takes no 0-d leaf
        state = tx.init(params)
        calls.clear()
        tables.clear()
        grads = {k: torch.empty_like(v) for k, v in params.items()}  # one buffer per gradient, as p.grad is
        with fadam.backend("triton"):
            for values in _grads():
                for k, g in grads.items():
                    g.copy_(values[k])
                params, state = fadam.step(tx, params, grads, state, donate=True)
        kind = torch.Tensor if capturable else list
        assert calls and all(found == (kind, kind) for found in calls)
        results[capturable] = _tensors((params, state))
    if name == "clip+adamw":
        assert len(tables) == STEPS and all(t is tables[0] for t in tables)
    for a, b in zip(results[True], results[False], strict=True):
        assert torch.equal(a, b)
