"""PSGD Kron: ``fadam.psgd_kron`` against kron_torch's equations written out below as a slow float64 loop over
leaves (every factor a matrix, inverses instead of triangular solves, the same random draws: fadam's generators),
and against kron_torch's ``Kron`` itself (float64 trajectories in tests/data/psgd_kron.json, from
scripts/psgd_kron_reference.py with kron_torch 0.3.3 on torch 2.13, fed the same draws); vmap over an ensemble,
16-bit params, composition, the default schedule, bad input."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import fadam
from fadam.transforms._psgd_kron import draw_generator, shared_draw
from tests import noisy_quadratic as quadratic

STEPS = 10
# "wide": 8 > the size limit 6; "tall" merges into (12, 2), not (6, 4) (kron_torch compares signed differences);
# "square": memory_save_mode="one_diag" makes the last of equal dims diagonal
SHAPES = {
    "vector": (3,),
    "matrix": (4, 5),
    "cube": (2, 3, 4),
    "wide": (3, 8),
    "tall": (6, 2, 2),
    "square": (3, 3),
    "scalar": (),
}
KRON_TORCH = json.loads((Path(__file__).parent / "data" / "psgd_kron.json").read_text())


def _annealed(min_prob: float, decay: float, flat_start: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """kron_torch's ``precond_update_prob_schedule`` (float32, as its ``ProbScheduler``)."""
    return lambda n: torch.exp(-decay * (n.to(torch.float32) - flat_start)).clamp(min_prob, 1.0)


# ------------------------------------------------------------------------------ kron_torch's equations written out


def _mode(x: torch.Tensor, m: torch.Tensor, d: int) -> torch.Tensor:
    """``m`` times every slice of ``x`` along ``d``."""
    return torch.movedim(torch.tensordot(m, x, dims=([1], [d])), 0, d)


def _triangular_dims(shape: tuple[int, ...], hp: dict[str, Any]) -> list[bool]:
    mode, n = hp.get("memory_save_mode"), len(shape)
    if n < hp.get("min_ndim_triangular", 2):
        return [False] * n
    largest = n - 1 - list(reversed(shape)).index(max(shape))
    second = sorted(shape)[-2] if n > 1 else 1
    one = mode == "one_diag" or (mode == "smart_one_diag" and n > 1 and sorted(shape)[-1] > sorted(shape)[-2])
    skew = hp.get("max_skew_triangular", math.inf)
    return [
        mode != "all_diag"
        and not (one and d == largest)
        and 1 < size <= hp["max_size_triangular"]
        and size <= skew * second
        for d, size in enumerate(shape)
    ]


def _lower_bound(s: torch.Tensor) -> torch.Tensor:
    """kron_torch's ``_lb``: from the column of largest norm, ``|S (S^T c) / |S^T c||``, on ``S / max|S|``."""
    scale = s.abs().max()
    if scale == 0:
        return scale
    a = s / scale
    c = a[:, int(torch.argmax((a * a).sum(0)))]
    x = a.T @ c
    return torch.linalg.norm(a @ (x / torch.linalg.norm(x))) * scale


def kron_reference(hp: dict[str, Any], key: int) -> Callable:
    """One step of kron_torch's ``Kron`` for every leaf (its ``_init_Q_exprs``, ``_balance_Q``, ``_update_precond``,
    ``_precond_grad``, ``_clip_update_rms``, ``dist_kron``'s ``BlockPartitioner``), every factor a matrix (a diagonal
    one as ``diag(q)``), its draws fadam's generators; returns whether it rebalanced."""
    lr, b1, wd = hp["learning_rate"], hp.get("b1", 0.9), hp.get("weight_decay", 0.0)
    eta, scale0 = hp.get("precond_lr", 0.1), hp.get("precond_init_scale", 1.0)
    probability = hp.get("preconditioner_update_probability", 1.0)
    block = hp.get("block_size", 1024) if hp.get("partition_grads", False) else None

    def working(shape: torch.Size) -> tuple[int, ...]:
        if len(shape) == 0:
            return (1,)
        if len(shape) <= 2 or not hp.get("merge_dims", True):
            return tuple(shape)
        a, b = (math.prod(shape[:-1]), shape[-1]), (shape[0], math.prod(shape[1:]))
        return a if a[1] - a[0] <= b[1] - b[0] else b

    def blocks_of(x: torch.Tensor) -> tuple[list[torch.Tensor], list[int]]:
        tri = _triangular_dims(tuple(x.shape), hp)
        dims = [d for d, n in enumerate(x.shape) if block is not None and tri[d] and n > block]
        parts = [x]
        for d in dims:
            parts = [
                piece for part in parts for piece in torch.tensor_split(part, list(range(block, x.shape[d], block)), d)
            ]
        return parts, dims

    def merge(parts: list[torch.Tensor], dims: list[int], shape: tuple[int, ...]) -> torch.Tensor:
        for d in reversed(dims):
            n = -(-shape[d] // block)
            parts = [torch.cat(parts[i : i + n], d) for i in range(0, len(parts), n)]
        return parts[0]

    def init(x: torch.Tensor) -> list:
        out = []
        for b in blocks_of(x)[0]:
            s = scale0 ** (1 / b.dim())
            out.append(
                [
                    torch.eye(n, dtype=b.dtype) * s if t else torch.ones(n, dtype=b.dtype) * s
                    for n, t in zip(b.shape, _triangular_dims(tuple(b.shape), hp))
                ]
            )
        return out

    def fit(qs: list, tri: list[bool], g: torch.Tensor, v: torch.Tensor) -> list:
        h = g + math.sqrt(torch.finfo(torch.float32).eps) * g.abs().mean() * v
        mats = [q if t else torch.diag(q) for q, t in zip(qs, tri)]
        a, b = h, v
        for d, m in enumerate(mats):
            a, b = _mode(a, m, d), _mode(b, torch.linalg.inv(m).T, d)
        new = []
        for d, (q, t) in enumerate(zip(qs, tri)):
            others = [k for k in range(a.dim()) if k != d]
            t1 = torch.tensordot(a, a, dims=(others, others))
            t2 = torch.tensordot(b, b, dims=(others, others))
            tiny = torch.finfo(torch.float64).tiny
            if t:
                new.append(q - eta * torch.triu(t1 - t2) / max(_lower_bound(t1 + t2), tiny) @ q)
            else:
                s1, s2 = torch.diagonal(t1), torch.diagonal(t2)
                new.append(q - eta * (s1 - s2) * q / max((s1 + s2).abs().max(), tiny))
        return new

    def step(params: dict, grads: dict, state: dict) -> tuple[dict, bool]:
        n = state.setdefault("n", 0)
        p_t = probability(torch.tensor(n)) if callable(probability) else probability
        state["counter"] = state.get("counter", 0) + 1
        update = bool(state["counter"] >= 1 / p_t)
        state["counter"] = 0 if update else state["counter"]
        rebalance = update and shared_draw(key, n) < 0.01
        new = {}
        for index, name in enumerate(sorted(params)):  # fadam's leaf order: a dict's sorted keys
            p, g = params[name], grads[name].reshape(working(params[name].shape))
            st = state.setdefault(name, {"mu": torch.zeros_like(g), "Q": init(g)})
            st["mu"] = b1 * st["mu"] + (1 - b1) * g
            m_hat = st["mu"] / (1 - b1 ** (n + 1))
            parts, dims = blocks_of(m_hat)
            fit_in = blocks_of(m_hat if hp.get("momentum_into_precond_update", True) else g)[0]
            if update:
                gen = draw_generator(key, n, index)
                for k, (part, qs) in enumerate(zip(fit_in, st["Q"])):
                    if rebalance and g.dim() > 1:
                        norms = [q.abs().max() for q in qs]
                        mean = math.exp(sum(math.log(x) for x in norms) / len(norms))
                        qs = [q * mean / x for q, x in zip(qs, norms)]
                    v = torch.randn(part.shape, generator=gen, dtype=part.dtype)
                    st["Q"][k] = fit(qs, _triangular_dims(tuple(part.shape), hp), part, v)
            out = []
            for part, qs in zip(parts, st["Q"]):
                for d, (q, t) in enumerate(zip(qs, _triangular_dims(tuple(part.shape), hp))):
                    m = q if t else torch.diag(q)
                    part = _mode(part, m.T @ m, d)
                out.append(part)
            u = merge(out, dims, tuple(m_hat.shape))
            if hp.get("clip_update_rms", True):
                u = u * min(1.0, 1.1 / (float(u.square().mean().sqrt()) + 1e-12))
            u = u.reshape(p.shape) + (wd * p if p.dim() >= 2 else 0.0)
            new[name] = p - lr * u
        state["n"] = n + 1
        return new, rebalance

    return step


EQUATION_CASES = [
    pytest.param(
        {"learning_rate": 0.05, "weight_decay": 0.01, "preconditioner_update_probability": 1.0},
        16,
        id="probability-1-merged",
    ),
    pytest.param(
        {
            "learning_rate": 0.03,
            "b1": 0.5,
            "preconditioner_update_probability": _annealed(0.3, 0.5, 2),
            "min_ndim_triangular": 1,
            "memory_save_mode": "one_diag",
            "momentum_into_precond_update": False,
            "precond_lr": 0.2,
            "precond_init_scale": 0.5,
            "merge_dims": False,
            "clip_update_rms": False,
        },
        12,
        id="schedule-one-diag-gradient-fit-unclipped",
    ),
    pytest.param(
        {
            "learning_rate": 0.05,
            "preconditioner_update_probability": 0.5,
            "partition_grads": True,
            "block_size": 2,
            "max_skew_triangular": 1.5,
        },
        117,
        id="partitioned-skew",
    ),
]


@pytest.mark.parametrize(("hp", "key"), EQUATION_CASES)
def test_psgd_kron_follows_kron_torchs_equations(hp: dict, key: int) -> None:
    """10 float64 steps within 1e-12 of kron_torch's equations written out, with the same draws (one step
    rebalancing the factors)."""
    tx = fadam.psgd_kron(**hp, max_size_triangular=6, key=key)
    reference = kron_reference({**hp, "max_size_triangular": 6}, key)
    params = quadratic.start(SHAPES)
    ref, ref_state, state = dict(params), {}, tx.init(params)
    worst, rebalanced = 0.0, 0
    for t in range(1, STEPS + 1):
        params, state = fadam.step(tx, params, {k: quadratic.gradient(k, p, t) for k, p in params.items()}, state)
        ref, balanced = reference(ref, {k: quadratic.gradient(k, p, t) for k, p in ref.items()}, ref_state)
        rebalanced += balanced
        worst = max(worst, max(float((params[k] - ref[k]).abs().max()) for k in ref))
    assert worst <= 1e-12, worst
    assert rebalanced == 1
    assert min(float((params[k] - p0).abs().max()) for k, p0 in quadratic.start(SHAPES).items()) > 0.02


def test_the_written_out_equations_can_fail() -> None:
    """The loop above tells the draws apart: another key's factors leave fadam's params by more than 1e-6."""
    hp = {"learning_rate": 0.05, "preconditioner_update_probability": 1.0, "clip_update_rms": False}
    tx, reference = (
        fadam.psgd_kron(**hp, max_size_triangular=6, key=1),
        kron_reference({**hp, "max_size_triangular": 6}, 2),
    )
    params, ref, ref_state = quadratic.start(SHAPES), quadratic.start(SHAPES), {}
    state = tx.init(params)
    for t in range(1, 4):
        params, state = fadam.step(tx, params, {k: quadratic.gradient(k, p, t) for k, p in params.items()}, state)
        ref, _ = reference(ref, {k: quadratic.gradient(k, p, t) for k, p in ref.items()}, ref_state)
    assert float((params["matrix"] - ref["matrix"]).abs().max()) > 1e-6


@pytest.mark.parametrize("case", KRON_TORCH["cases"], ids=lambda case: case["name"])
def test_psgd_kron_matches_kron_torch(case: dict) -> None:
    """kron_torch's Kron on its own gradients with fadam's draws: every step's params and the final factors within
    1e-6 (measured 3e-8: kron_torch's triangular solves are float32, see the script)."""
    kwargs = dict(case["kwargs"])
    kwargs["learning_rate"] = kwargs.pop("lr")
    if case["schedule"] is not None:
        kwargs["preconditioner_update_probability"] = _annealed(**case["schedule"])
    tx = fadam.psgd_kron(**kwargs, max_size_triangular=6, key=case["key"])
    params = {k: quadratic.f64(v) for k, v in case["start"].items()}
    state = tx.init(params)
    for t, (grads, want) in enumerate(zip(case["grads"], case["params"]), start=1):
        params, state = fadam.step(tx, params, {k: quadratic.f64(g) for k, g in grads.items()}, state)
        for k, v in want.items():
            err = float((params[k] - quadratic.f64(v)).abs().max())
            assert err <= 1e-6, f"step {t}, {k}: {err:.2e}"
    factors = state[0].preconditioners
    for k, want in case["preconditioners"].items():
        for q, q_want in zip(factors[k], want, strict=True):
            assert float((q - quadratic.f64(q_want)).abs().max()) <= 1e-6, k
    assert case["balanced_steps"]
    assert float((factors["matrix"][0] - torch.eye(4) * factors["matrix"][0][0, 0]).abs().max()) > 0.05


# --------------------------------------------------------------------------------------- composition and inputs


def test_the_default_schedule_updates_every_34th_step_from_step_4000() -> None:
    """``None``: kron_torch's annealing, 1 for 500 steps, then down to 0.03: from the count 5000, the factors move
    once the counter of steps since their last move reaches 1 / 0.03 (33.3)."""
    tx = fadam.scale_by_psgd_kron()
    params = {"w": torch.ones(3, 2)}
    state = tx.init(params)._replace(count=torch.tensor(5000, dtype=torch.int32))
    moved = []
    for counter in (31, 32, 33):
        before = state._replace(update_counter=torch.tensor(counter, dtype=torch.int32))
        _, after = tx.update({"w": torch.ones(3, 2)}, before)
        moved.append(not torch.equal(after.preconditioners["w"][0], before.preconditioners["w"][0]))
        assert int(after.update_counter) == (0 if moved[-1] else counter + 1)
    assert moved == [False, False, True]
    _, first = tx.update({"w": torch.ones(3, 2)}, tx.init(params))
    assert int(first.update_counter) == 0 and not torch.equal(first.preconditioners["w"][0], torch.eye(3))


def test_the_key_seeds_the_draws() -> None:
    """The same key gives the same factors; another key others (the draws are a pure function of the state)."""
    params = {"w": torch.ones(3, 2, dtype=torch.float64)}
    grads = {"w": torch.arange(6.0, dtype=torch.float64).reshape(3, 2)}
    runs = []
    for key in (7, 7, 8):
        tx = fadam.scale_by_psgd_kron(key=key)
        runs.append(tx.update(grads, tx.init(params))[1].preconditioners["w"][0])
    assert torch.equal(runs[0], runs[1])
    assert float((runs[0] - runs[2]).abs().max()) > 1e-6


def test_vmap_over_an_ensemble_equals_each_member_alone() -> None:
    """Three members stepped together by ``torch.func.vmap`` (each member stepped alone inside) equal each member
    stepped alone, within 1e-12."""
    shapes = {"matrix": (4, 5), "vector": (3,)}
    stacked, members = quadratic.ensemble_and_members(
        fadam.psgd_kron(0.05, preconditioner_update_probability=0.5), shapes, steps=4
    )
    for i, params in enumerate(members):
        for k in shapes:
            assert float((stacked[k][i] - params[k]).abs().max()) <= 1e-12, (i, k)


def test_16_bit_params_keep_float32_state() -> None:
    shapes = {"matrix": (4, 5), "vector": (3,), "scalar": ()}
    assert quadratic.float_state_dtypes_after_bfloat16_steps(fadam.psgd_kron(0.05), shapes, 3) == {torch.float32}


def test_partition_and_inject_hyperparams_give_the_plain_numbers() -> None:
    """PSGD Kron on the matrices and AdamW on the rest equal each alone, and inject_hyperparams' wrapper equals the
    plain alias, bit for bit."""
    params = quadratic.start({"matrix": (4, 5), "cube": (2, 3, 4), "vector": (3,)})
    labels = {"matrix": "kron", "cube": "kron", "vector": "adamw"}
    tx = fadam.partition({"kron": fadam.psgd_kron(0.05, key=3), "adamw": fadam.adamw(0.01)}, labels)
    kron, adamw = fadam.psgd_kron(0.05, key=3), fadam.adamw(0.01)
    injected = fadam.inject_hyperparams(fadam.psgd_kron)(learning_rate=0.05, weight_decay=0.1, precond_lr=0.2)
    plain = fadam.psgd_kron(0.05, weight_decay=0.1, precond_lr=0.2)
    matrices, vectors = {k: params[k] for k in ("matrix", "cube")}, {"vector": params["vector"]}
    state, kron_state, adamw_state = tx.init(params), kron.init(matrices), adamw.init(vectors)
    p_injected, p_plain = params, params
    s_injected, s_plain = injected.init(params), plain.init(params)
    for t in range(1, 4):
        grads = {k: quadratic.gradient(k, p, t) for k, p in params.items()}
        params, state = fadam.step(tx, params, grads, state)
        matrices, kron_state = fadam.step(kron, matrices, {k: grads[k] for k in matrices}, kron_state)
        vectors, adamw_state = fadam.step(adamw, vectors, {"vector": grads["vector"]}, adamw_state)
        p_injected, s_injected = fadam.step(injected, p_injected, grads, s_injected)
        p_plain, s_plain = fadam.step(plain, p_plain, grads, s_plain)
    assert all(torch.equal(params[k], v) for k, v in {**matrices, **vectors}.items())
    assert all(torch.equal(p_injected[k], p_plain[k]) for k in p_plain)


def test_init_refuses_complex_params() -> None:
    with pytest.raises(ValueError, match=r"real params only: param \['z'\] is torch.complex64"):
        fadam.scale_by_psgd_kron().init({"w": torch.zeros(2, 2), "z": torch.zeros(3, dtype=torch.complex64)})


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: fadam.psgd_kron(b1=1.0), "Invalid b1: 1.0"),
        (lambda: fadam.psgd_kron(preconditioner_update_probability=0.0), "Invalid preconditioner_update_probability"),
        (lambda: fadam.psgd_kron(preconditioner_update_probability=1.5), "expected 0 < p <= 1"),
        (lambda: fadam.psgd_kron(memory_save_mode="two_diag"), "Invalid memory_save_mode: 'two_diag'"),
        (lambda: fadam.psgd_kron(max_size_triangular=0), "Invalid max_size_triangular: 0"),
        (lambda: fadam.psgd_kron(min_ndim_triangular=1.5), "Invalid min_ndim_triangular: 1.5"),
        (lambda: fadam.psgd_kron(block_size=0), "Invalid block_size: 0"),
        (lambda: fadam.psgd_kron(precond_lr=0.0), "Invalid precond_lr: 0.0"),
        (lambda: fadam.psgd_kron(precond_init_scale=-1.0), "Invalid precond_init_scale: -1.0"),
        (lambda: fadam.psgd_kron(max_skew_triangular=0.0), "Invalid max_skew_triangular: 0.0"),
        (lambda: fadam.psgd_kron(key=-1), r"Invalid key: -1 \(expected an int"),
        (lambda: fadam.psgd_kron(key=1.5), "Invalid key: 1.5"),
        (lambda: fadam.psgd_kron(precond_dtype=torch.float16), "Invalid precond_dtype"),
        (lambda: fadam.psgd_kron(learning_rate=-1.0), "Invalid learning rate: -1.0"),
        (lambda: fadam.psgd_kron(weight_decay=-0.1), "Invalid weight_decay value: -0.1"),
    ],
)
def test_bad_hyperparameters_are_refused(make: Callable, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_state_round_trips_through_torch_save(tmp_path: Path) -> None:
    """The state is plain tensors and containers: ``torch.load(weights_only=True)`` reads it back."""
    tx = fadam.psgd_kron(0.05, partition_grads=True, block_size=2)
    params = quadratic.start({"matrix": (4, 5), "scalar": ()})
    params, state = fadam.step(tx, params, {k: quadratic.gradient(k, p, 1) for k, p in params.items()}, tx.init(params))
    torch.save(state, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    assert type(loaded[0]) is fadam.ScaleByPsgdKronState and len(loaded[0].preconditioners["matrix"]) == 12
    grads = {k: quadratic.gradient(k, p, 2) for k, p in params.items()}
    after, after_loaded = fadam.step(tx, params, grads, state)[0], fadam.step(tx, params, grads, loaded)[0]
    assert all(torch.equal(after[k], after_loaded[k]) for k in after)
