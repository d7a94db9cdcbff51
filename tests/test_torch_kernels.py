"""Torch's fused kernels chosen from the program (``fadam._torch_kernels``): which chains are recognized, wherever
they come from, that the steps they take are torch.optim's ``fused=True`` steps bit for bit, and how far those steps
lie from the eager path's."""

from __future__ import annotations

from collections.abc import Callable

import optree
import pytest
import torch

import fadam
from fadam._program import program_of, state_at
from fadam._torch_kernels import torch_kernel
from tests.ulps import param_ulps, ulp, ulps


def _params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"w": torch.randn(7, 5, generator=gen), "b": torch.randn(5, generator=gen)}


def _grads(steps: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [{k: torch.randn(v.shape, generator=gen) for k, v in _params().items()} for _ in range(steps)]


def _kernels(tx: fadam.GradientTransformation) -> list[str]:
    """The backend of each line of ``explain``, one line per group of leaves."""
    return [line.split(": ")[1] for line in fadam.explain(tx, _params()).splitlines()]


RECOGNIZED = {
    "adam": (lambda: fadam.adam(1e-2), ["torch._fused_adam_"]),
    "adam-decay-maximize-amsgrad": (
        lambda: fadam.adam(1e-2, weight_decay=0.1, maximize=True, amsgrad=True),
        ["torch._fused_adam_"],
    ),
    "adamw": (lambda: fadam.adamw(1e-2), ["torch._fused_adamw_"]),
    "adamw-schedule": (lambda: fadam.adamw(fadam.linear_schedule(1e-2, 1e-3, 10)), ["torch._fused_adamw_"]),
    "sgd": (lambda: fadam.sgd(0.1), ["torch._fused_sgd_"]),
    "sgd-nesterov-decay": (
        lambda: fadam.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.1),
        ["torch._fused_sgd_"],
    ),
    "adagrad": (lambda: fadam.adagrad(0.1, lr_decay=0.01), ["torch._fused_adagrad_"]),
    "composed-adamw": (
        lambda: fadam.chain(
            fadam.scale_by_adam(), fadam.scale_by_learning_rate(1e-2), fadam.add_decoupled_weight_decay(1e-2, 0.1)
        ),
        ["torch._fused_adamw_"],
    ),
    "inject_hyperparams": (lambda: fadam.inject_hyperparams(fadam.adamw)(lr=1e-2), ["torch._fused_adamw_"]),
    "partition": (
        lambda: fadam.partition({"a": fadam.adam(1e-2), "s": fadam.sgd(0.1)}, {"w": "a", "b": "s"}),
        ["torch._fused_adam_", "torch._fused_sgd_"],
    ),
}

KERNEL = "generated CPU kernel"
NOT_RECOGNIZED = {
    "adam-nesterov": lambda: fadam.chain(fadam.scale_by_adam(nesterov=True), fadam.scale_by_learning_rate(1e-2)),
    "adam-eps_root": lambda: fadam.chain(fadam.scale_by_adam(eps_root=1e-8), fadam.scale_by_learning_rate(1e-2)),
    "adam-tensor-betas": lambda: fadam.adam(1e-2, betas=(torch.tensor(0.9), torch.tensor(0.999))),
    "decay-of-another-lr": lambda: fadam.chain(
        fadam.scale_by_adam(), fadam.scale_by_learning_rate(1e-2), fadam.add_decoupled_weight_decay(2e-2, 0.1)
    ),
    "ascent": lambda: fadam.chain(fadam.scale_by_adam(), fadam.scale_by_learning_rate(1e-2, flip_sign=False)),
    "clip-then-adamw": lambda: fadam.chain(fadam.clip_by_global_norm(1.0), fadam.adamw(1e-2)),
    "decay-after-adam": lambda: fadam.chain(
        fadam.scale_by_adam(), fadam.add_decayed_weights(0.1), fadam.scale_by_learning_rate(1e-2)
    ),
}


@pytest.mark.parametrize("name", RECOGNIZED)
def test_a_chain_of_a_torch_kernel_takes_it(name):
    make, expected = RECOGNIZED[name]
    assert _kernels(make()) == expected
    with fadam.backend("kernel"):
        assert set(_kernels(make())) == {KERNEL}


@pytest.mark.parametrize("name", NOT_RECOGNIZED)
def test_another_chain_takes_the_generated_kernel(name):
    assert set(_kernels(NOT_RECOGNIZED[name]())) == {KERNEL}


def _torch_run(make: Callable[[list], torch.optim.Optimizer], params: dict, grads: list, keys: list[str]) -> dict:
    """The params after torch.optim's steps over the leaves named in ``keys``, the others kept."""
    tensors = {k: v.clone() for k, v in params.items()}
    optimizer = make([tensors[k] for k in keys])
    for g in grads:
        for k in keys:
            tensors[k].grad = g[k].clone()
        optimizer.step()
    return tensors


def _fadam_run(tx: fadam.GradientTransformation, params: dict, grads: list, donate: bool) -> dict:
    current = {k: v.clone() for k, v in params.items()}
    state = tx.init(current)
    for g in grads:
        current, state = fadam.step(tx, current, g, state, donate=donate)
    return current


ADAMW = {"lr": 1e-2, "weight_decay": 0.1}
SAME_AS_TORCH = {
    "composed-adamw": (
        lambda: fadam.chain(
            fadam.scale_by_adam(), fadam.scale_by_learning_rate(1e-2), fadam.add_decoupled_weight_decay(1e-2, 0.1)
        ),
        lambda p: torch.optim.AdamW(p, fused=True, **ADAMW),
        ["w", "b"],
    ),
    "inject_hyperparams-adamw": (
        lambda: fadam.inject_hyperparams(fadam.adamw)(**ADAMW),
        lambda p: torch.optim.AdamW(p, fused=True, **ADAMW),
        ["w", "b"],
    ),
    "apply_if_finite-sgd": (
        lambda: fadam.apply_if_finite(fadam.sgd(0.1, momentum=0.9, nesterov=True), 3),
        lambda p: torch.optim.SGD(p, 0.1, momentum=0.9, nesterov=True, fused=True),
        ["w", "b"],
    ),
}


@pytest.mark.parametrize("donate", [False, True], ids=["kept", "donated"])
@pytest.mark.parametrize("name", SAME_AS_TORCH)
def test_steps_equal_torch_fused_bit_for_bit(name, donate):
    make, make_torch, keys = SAME_AS_TORCH[name]
    params, grads = _params(), _grads(10)
    ours, theirs = _fadam_run(make(), params, grads, donate), _torch_run(make_torch, params, grads, keys)
    for k in params:
        assert torch.equal(ours[k], theirs[k]), k


def test_partition_steps_each_group_with_its_kernel_as_torch():
    params, grads = _params(), _grads(10)
    tx = fadam.partition({"a": fadam.adamw(**ADAMW), "s": fadam.sgd(0.1, momentum=0.9)}, {"w": "a", "b": "s"})
    ours = _fadam_run(tx, params, grads, donate=True)
    adamw = _torch_run(lambda p: torch.optim.AdamW(p, fused=True, **ADAMW), params, grads, ["w"])
    sgd = _torch_run(lambda p: torch.optim.SGD(p, 0.1, momentum=0.9, fused=True), params, grads, ["b"])
    assert torch.equal(ours["w"], adamw["w"]) and torch.equal(ours["b"], sgd["b"])


def test_masked_steps_the_selected_leaves_as_torch_and_passes_the_others():
    params, grads = _params(), _grads(10)
    ours = _fadam_run(fadam.masked(fadam.adamw(**ADAMW), {"w": True, "b": False}), params, grads, donate=True)
    adamw = _torch_run(lambda p: torch.optim.AdamW(p, fused=True, **ADAMW), params, grads, ["w"])
    passed = params["b"]
    for g in grads:  # masked leaves' updates are the gradients as they came (optax's masked)
        passed = passed + g["b"]
    assert torch.equal(ours["w"], adamw["w"]) and torch.equal(ours["b"], passed)


def test_a_param_without_a_gradient_is_left_as_it_is():
    params, grads = _params(), _grads(1)
    tx = fadam.adamw(**ADAMW)
    state = tx.init(params)
    new_params, new_state = fadam.step(tx, params, {**grads[0], "b": None}, state)
    torch_params = _torch_run(lambda p: torch.optim.AdamW(p, fused=True, **ADAMW), params, grads, ["w"])
    assert torch.equal(new_params["w"], torch_params["w"]) and torch.equal(new_params["b"], params["b"])
    assert torch.equal(new_state[0].mu["b"], state[0].mu["b"]) and torch.equal(new_state[0].nu["b"], state[0].nu["b"])


def test_a_schedule_of_the_learning_rate_is_read_each_step():
    schedule = fadam.linear_schedule(1e-2, 1e-3, 5)
    params, grads = _params(), _grads(6)
    ours = _fadam_run(fadam.adamw(schedule, weight_decay=0.1), params, grads, donate=True)
    tensors = {k: v.clone() for k, v in params.items()}
    optimizer = torch.optim.AdamW(list(tensors.values()), fused=True, weight_decay=0.1)
    for step, g in enumerate(grads):
        optimizer.param_groups[0]["lr"] = float(schedule(torch.tensor(step)))
        for k in tensors:
            tensors[k].grad = g[k].clone()
        optimizer.step()
    for k in params:
        assert torch.equal(ours[k], tensors[k]), k


@pytest.mark.parametrize(("name", "kernel_name"), [("adamw", "_fused_adamw_"), ("sgd", "_fused_sgd_")])
def test_on_cuda_a_schedules_lr_reaches_the_kernel_as_a_float32_tensor(name, kernel_name, monkeypatch):
    """torch's CUDA kernels read a tensor lr through a ``float`` pointer (and refuse a float64 one): the schedule's
    float64 value goes to them as float32, on the params' device, without a host sync. Checked on the CPU by
    recording what the kernel is given."""
    tx = {"adamw": fadam.adamw, "sgd": fadam.sgd}[name](fadam.linear_schedule(1e-2, 1e-3, 5))
    program, state = program_of(tx).expanded(tx.init({"w": torch.ones(3)}))
    stage_states = [state_at(state, stage.path) for stage in program.stages]
    scalars = [stage.decl.scalars(s, [torch.ones(3)]) for stage, s in zip(program.stages, stage_states)]
    assert any(isinstance(v, torch.Tensor) and v.dtype == torch.float64 for found in scalars for v in found.values())
    given: dict = {}
    monkeypatch.setattr(torch, kernel_name, lambda *args, **kwargs: given.update(kwargs))
    kernel = torch_kernel(tuple(stage.decl for stage in program.stages), stage_states, scalars, "cuda")
    moments = [[torch.zeros(3)]] * (2 if name == "adamw" else 0)
    kernel.run(torch.device("cpu"), [torch.ones(3)], [torch.ones(3)], *moments)
    assert given["lr"].dtype == torch.float32 and given["lr"].is_cpu
    assert given["lr"] == torch.tensor(1e-2, dtype=torch.float32)


# torch's fused kernels against the eager path, a step at a time from the eager path's trajectory: the bound README
# states. The params within PARAM_ULPS ulps of the update beyond their own rounding; the state within STATE_ULPS ulps
# of itself. Where terms may cancel (SGD's momentum ``momentum * buf + g + wd * p``, which torch's kernel computes
# with a fused multiply-add, and its Nesterov update ``lr * (g + wd * p + momentum * buf')``), in ulps of the terms'
# magnitude instead
PARAM_ULPS = 4
STATE_ULPS = 1
FUSED_ROUTES = {
    "adam": (lambda: fadam.adam(1e-2, weight_decay=0.1), "torch._fused_adam_"),
    "adam-amsgrad": (lambda: fadam.adam(1e-2, amsgrad=True), "torch._fused_adam_"),
    "adamw": (lambda: fadam.adamw(1e-2, weight_decay=0.1), "torch._fused_adamw_"),
    "sgd-nesterov": (lambda: fadam.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.1), "torch._fused_sgd_"),
    "adagrad": (lambda: fadam.adagrad(0.1, lr_decay=0.01, weight_decay=0.1), "torch._fused_adagrad_"),
}
STATE_TERMS = {"sgd-nesterov": lambda old, g, p: 0.9 * old.abs() + g.abs() + 0.1 * p.abs()}
UPDATE_TERMS = {"sgd-nesterov": lambda new, g, p: 0.1 * (g.abs() + 0.1 * p.abs() + 0.9 * new.abs())}


def _beyond_rounding(found: torch.Tensor, eager: torch.Tensor, scale: torch.Tensor) -> int:
    """How far a new param ``found`` is from the eager path's beyond the param's own rounding, in ulps of ``scale``."""
    excess = (found.double() - eager.double()).abs() - ulp(eager)
    return int(torch.ceil(excess.clamp(min=0) / ulp(scale.to(found.dtype))).max())


def _wide_grads(params: dict[str, torch.Tensor], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Magnitudes from 1e-6 to 1e2."""
    found = {}
    for k, p in params.items():
        magnitudes = 10.0 ** torch.randint(-6, 3, p.shape, generator=gen)
        found[k] = (torch.randn(p.shape, generator=gen, dtype=torch.float64) * magnitudes).to(p.dtype)
    return found


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name", FUSED_ROUTES)
def test_torchs_fused_steps_stay_within_the_stated_bound_of_the_eager_path(name, dtype):
    make, kernel = FUSED_ROUTES[name]
    tx = make()
    gen = torch.Generator().manual_seed(2)
    params = {"w": torch.randn(3000, generator=gen, dtype=dtype), "b": torch.randn(7, 5, generator=gen, dtype=dtype)}
    assert {line.split(": ")[1] for line in fadam.explain(tx, params).splitlines()} == {kernel}
    state = tx.init(params)
    for step in range(20):
        grads = _wide_grads(params, gen)
        with fadam.backend("eager"):
            updates, eager_state = tx.update(grads, state, params)
        eager_params = fadam.apply_updates(params, updates)
        fused_params, fused_state = fadam.step(tx, params, grads, state)
        moments = [
            (path, old, new, found)
            for path, old, new, found in zip(
                optree.tree_paths(state), *(optree.tree_leaves(s) for s in (state, eager_state, fused_state))
            )
            if new.dim()  # the per-element state, not the step count
        ]
        for path, old, new, found in moments:
            key = path[-1]
            if name in STATE_TERMS:
                scale = ulp(STATE_TERMS[name](old, grads[key], params[key]).to(dtype))
                distance = int(torch.ceil((found.double() - new.double()).abs() / scale).max())
            else:
                distance = ulps(found, new)
            assert distance <= STATE_ULPS, (step, path, distance)
        for k in params:
            if name in UPDATE_TERMS:
                new = next(new for path, _, new, _ in moments if path[-1] == k)
                terms = UPDATE_TERMS[name](new, grads[k], params[k])
                distance = _beyond_rounding(fused_params[k], eager_params[k], terms)
            else:
                distance = param_ulps(fused_params[k], eager_params[k], updates[k])
            assert distance <= PARAM_ULPS, (step, k, distance)
        params, state = eager_params, eager_state
