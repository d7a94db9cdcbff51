"""SOAP and Shampoo: ``fadam.soap`` against the official SOAP implementation's algorithm and ``fadam.shampoo`` against
its documented equations, each written out below as a slow float64 loop over leaves (precondition refreshes, a dim
above the size limit, merged dims); ``fadam.soap`` against heavyball's SOAP (float64 trajectories in
tests/data/heavyball_soap.json, from scripts/heavyball_soap_reference.py with heavyball 3.2.1 on torch 2.13); vmap
over an ensemble, 16-bit params, composition, DTensor params (SOAP's, Shampoo's and PSGD Kron's shared path), bad
input. The conformance battery runs them too (tests/conformance/rows_soap.py)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import fadam
from tests import noisy_quadratic as quadratic

STEPS = 15
SHAPES = {"vector": (3,), "matrix": (4, 5), "cube": (2, 3, 4), "wide": (3, 12)}  # "wide": 12 > the size limit 10
HEAVYBALL = json.loads((Path(__file__).parent / "data" / "heavyball_soap.json").read_text())


def _worst_error(tx: fadam.GradientTransformation, reference: Callable, shapes: dict) -> tuple[float, float]:
    """The largest difference between ``tx``'s params and the reference's over ``STEPS`` steps, each on its own
    params' gradients, and how far the params moved."""
    params = quadratic.start(shapes)
    ref = {k: v.clone() for k, v in params.items()}
    state, ref_state = tx.init(params), {}
    worst = 0.0
    for t in range(1, STEPS + 1):
        grads = {k: quadratic.gradient(k, p, t) for k, p in params.items()}
        params, state = fadam.step(tx, params, grads, state)
        ref = reference(ref, {k: quadratic.gradient(k, p, t) for k, p in ref.items()}, ref_state)
        worst = max(worst, max(float((params[k] - ref[k]).abs().max()) for k in ref))
    moved = min(float((params[k] - p0).abs().max()) for k, p0 in quadratic.start(shapes).items())
    return worst, moved


# ---------------------------------------------------------------------------- SOAP, the official code written out


def _merged(shape: tuple[int, ...], max_dim: int) -> list[int]:
    out, run = [], 1
    for n in shape:
        if run * n <= max_dim:
            run *= n
        elif run > 1:
            out.append(run)
            run = n
        else:
            out.append(n)
    return [*out, run] if run > 1 or not out else out


def soap_reference(hp: dict[str, Any]) -> Callable:
    """One step of the official SOAP for every leaf (its ``step``, ``project``, ``project_back``,
    ``update_preconditioner``, ``get_orthogonal_matrix(_QR)``), with AdamW's decay (of the params before the step)."""
    lr, (b1, b2) = hp.get("learning_rate", 3e-3), hp.get("betas", (0.95, 0.95))
    beta_s = hp.get("shampoo_beta", -1.0)
    beta_s = b2 if beta_s < 0 else beta_s
    eps, wd, freq = hp.get("eps", 1e-8), hp.get("weight_decay", 0.01), hp.get("precondition_frequency", 10)
    max_dim, merge = hp.get("max_precond_dim", 10000), hp.get("merge_dims", False)
    channels_last = hp.get("data_format", "channels_first") == "channels_last"

    def view(x: torch.Tensor) -> torch.Tensor:
        if not merge or x.dim() < 2:
            return x
        x = x.permute(0, 3, 1, 2) if channels_last and x.dim() == 4 else x
        return x.reshape(_merged(tuple(x.shape), max_dim))

    def unview(x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        if merge and channels_last and len(shape) == 4:
            return x.reshape(shape[0], shape[3], shape[1], shape[2]).permute(0, 2, 3, 1)
        return x.reshape(shape)

    def project(x: torch.Tensor, qs: list, back: bool = False) -> torch.Tensor:
        w = view(x)
        for q in qs:  # contracts dim 0 and appends the result: after every dim the order is back
            w = w.permute(*range(1, w.dim()), 0) if q is None else torch.tensordot(w, q, dims=([0], [1 if back else 0]))
        return unview(w, x.shape)

    def update_preconditioner(st: dict, g: torch.Tensor) -> None:
        if st["Q"] is not None:
            st["exp_avg"] = project(st["exp_avg"], st["Q"], back=True)
        w = view(g)
        for k, m in enumerate(st["GG"]):
            if m is not None:
                others = [d for d in range(w.dim()) if d != k]
                st["GG"][k] = beta_s * m + (1 - beta_s) * torch.tensordot(w, w, dims=(others, others))
        if st["Q"] is None:
            eye = [None if m is None else 1e-30 * torch.eye(len(m), dtype=m.dtype) for m in st["GG"]]
            st["Q"] = [None if m is None else torch.linalg.eigh(m + e)[1].flip(1) for m, e in zip(st["GG"], eye)]
        if st["step"] > 0 and st["step"] % freq == 0:
            sq = view(st["exp_avg_sq"])
            for k, (m, o) in enumerate(zip(st["GG"], st["Q"])):
                if m is None:
                    continue
                order = torch.argsort(torch.diag(o.T @ m @ o), descending=True)
                sq = sq.index_select(k, order)
                st["Q"][k] = torch.linalg.qr(m @ o[:, order])[0]
            st["exp_avg_sq"] = unview(sq, g.shape)
        if st["step"] > 0:
            st["exp_avg"] = project(st["exp_avg"], st["Q"])

    def init(g: torch.Tensor) -> dict:
        if g.dim() == 1:
            shapes = [g.shape[0] if hp.get("precondition_1d", False) and g.shape[0] <= max_dim else None]
        else:
            shapes = [n if n <= max_dim else None for n in view(g).shape]
        gg = [None if n is None else torch.zeros(n, n, dtype=g.dtype) for n in shapes]
        return {"step": 0, "exp_avg": torch.zeros_like(g), "exp_avg_sq": torch.zeros_like(g), "GG": gg, "Q": None}

    def step(params: dict, grads: dict, state: dict) -> dict:
        new = {}
        for name, p in params.items():
            g = grads[name]
            if name not in state:
                state[name] = init(g)
                update_preconditioner(state[name], g)
                new[name] = p  # the first step is skipped: the projection never uses the current gradient
                continue
            st = state[name]
            projected = project(g, st["Q"])
            st["step"] += 1
            st["exp_avg"] = b1 * st["exp_avg"] + (1 - b1) * projected
            st["exp_avg_sq"] = b2 * st["exp_avg_sq"] + (1 - b2) * projected**2
            size = lr
            if hp.get("correct_bias", True):
                size = lr * math.sqrt(1 - b2 ** st["step"]) / (1 - b1 ** st["step"])
            direction = project(st["exp_avg"] / (st["exp_avg_sq"].sqrt() + eps), st["Q"], back=True)
            if hp.get("normalize_grads", False):
                direction = direction / (1e-30 + direction.square().mean().sqrt())
            new[name] = p * (1 - lr * wd) - size * direction
            update_preconditioner(st, g)
        return new

    return step


SOAP_CASES = [
    pytest.param({"learning_rate": 0.05, "precondition_frequency": 3, "max_precond_dim": 10}, SHAPES, id="defaults"),
    pytest.param(
        {
            "learning_rate": 0.02,
            "betas": (0.9, 0.99),
            "shampoo_beta": 0.8,
            "weight_decay": 0.0,
            "precondition_frequency": 2,
            "max_precond_dim": 10,
            "precondition_1d": True,
            "normalize_grads": True,
            "correct_bias": False,
        },
        {**SHAPES, "vector": (2,)},  # a vector's first statistic has rank 1: 2 dims make its eigenbasis unique
        id="vectors-normalized-uncorrected",
    ),
    pytest.param(
        {
            "learning_rate": 0.03,
            "weight_decay": 0.1,
            "precondition_frequency": 4,
            "max_precond_dim": 10,
            "merge_dims": True,
            "data_format": "channels_last",
        },
        {"conv": (2, 3, 2, 2), "cube": (2, 3, 4), "scalar": (), "vector": (3,)},  # conv: (2, 2, 3, 2) -> (4, 6)
        id="merged-channels-last",
    ),
]


@pytest.mark.parametrize(("hp", "shapes"), SOAP_CASES)
def test_soap_follows_the_official_algorithm(hp: dict, shapes: dict) -> None:
    """15 float64 steps (refreshes every 2 to 4 steps) within 1e-12 of the official algorithm written out (measured
    2e-15)."""
    worst, moved = _worst_error(fadam.soap(**hp), soap_reference(hp), shapes)
    assert worst <= 1e-12, worst
    assert moved > 0.05


@pytest.mark.parametrize("case", HEAVYBALL["cases"], ids=lambda case: case["name"])
def test_soap_matches_heavyball(case: dict) -> None:
    """heavyball's SOAP on its own gradients: every step's params within 1e-6 (measured 2e-7; heavyball lifts the
    statistic in its power step and divides by max(sqrt(v_hat), eps), see the script)."""
    kwargs = dict(case["kwargs"])
    kwargs["learning_rate"], kwargs["betas"] = kwargs.pop("lr"), tuple(kwargs["betas"])
    tx = fadam.soap(**{"precondition_frequency": 2, **kwargs}, max_precond_dim=10)
    params = {k: quadratic.f64(v) for k, v in case["start"].items()}
    state = tx.init(params)
    for t, (grads, want) in enumerate(zip(case["grads"], case["params"]), start=1):
        params, state = fadam.step(tx, params, {k: quadratic.f64(g) for k, g in grads.items()}, state)
        for k, v in want.items():
            err = float((params[k] - quadratic.f64(v)).abs().max())
            assert err <= 1e-6, f"step {t}, {k}: {err:.2e}"
    assert float((params["matrix"] - quadratic.f64(case["start"]["matrix"])).abs().max()) > 0.3


# ---------------------------------------------------------------------------------- Shampoo, its equations written out


def shampoo_reference(hp: dict[str, Any]) -> Callable:
    """One step of ``fadam.shampoo``'s documented update for every leaf, by explicit loops and tensordot."""
    lr, (b1, b2) = hp.get("learning_rate", 1e-2), hp.get("betas", (0.9, 1.0))
    eps, momentum, wd = hp.get("epsilon", 1e-12), hp.get("momentum", 0.0), hp.get("weight_decay", 0.0)
    freq, max_dim = hp.get("precondition_frequency", 1), hp.get("max_preconditioner_dim", 1024)
    start = hp.get("start_preconditioning_step", -1)
    start = freq if start == -1 else start
    grafting, gb2, geps = hp.get("grafting"), hp.get("grafting_beta2", 0.999), hp.get("grafting_epsilon", 1e-10)
    correct, decoupled = hp.get("use_bias_correction", True), hp.get("use_decoupled_weight_decay", True)

    def dims_of(shape: torch.Size) -> list[int]:
        if len(shape) == 0 or (len(shape) == 1 and not hp.get("precondition_1d", False)):
            return []
        return [d for d, n in enumerate(shape) if n <= max_dim]

    def step(params: dict, grads: dict, state: dict) -> dict:
        new = {}
        for name, p in params.items():
            g = grads[name] if decoupled else grads[name] + wd * p
            dims = dims_of(p.shape)
            st = state.setdefault(
                name,
                {
                    "t": 0,
                    "mu": torch.zeros_like(p),
                    "nu": torch.zeros_like(p),
                    "buf": None,
                    "L": {d: torch.zeros(p.shape[d], p.shape[d], dtype=p.dtype) for d in dims},
                    "P": {},
                },
            )
            st["t"] += 1
            t = st["t"]
            st["nu"] = st["nu"] + g * g if grafting == "adagrad" else gb2 * st["nu"] + (1 - gb2) * g * g
            for d in dims:
                others = [k for k in range(p.dim()) if k != d]
                outer = torch.tensordot(g, g, dims=(others, others))
                st["L"][d] = st["L"][d] + outer if b2 == 1 else b2 * st["L"][d] + (1 - b2) * outer
            st["mu"] = b1 * st["mu"] + (1 - b1) * g
            m_hat = st["mu"] / (1 - b1**t) if correct else st["mu"]
            if t % freq == 0:
                c2 = 1 - b2**t if correct and b2 < 1 else 1.0
                root = hp.get("inv_root_override", 0) or 2 * p.dim()
                for d in dims:
                    values, vectors = torch.linalg.eigh(st["L"][d] / c2 + eps * torch.eye(p.shape[d]))
                    st["P"][d] = vectors @ torch.diag(values ** (-1 / root)) @ vectors.T
            nu_hat = st["nu"] / (1 - gb2**t) if grafting == "adam" else st["nu"]
            grafted = m_hat / (nu_hat.sqrt() + geps) if grafting else m_hat
            u = grafted
            if t >= start and dims:
                u = m_hat
                for d in dims:  # P_d applied along dim d; the preconditioners are symmetric
                    u = torch.movedim(torch.tensordot(u, st["P"][d], dims=([d], [0])), -1, d)
                if grafting:
                    u = u * grafted.norm() / (u.norm() + 1e-16)
            st["buf"] = u if st["buf"] is None else momentum * st["buf"] + u
            u = u + momentum * st["buf"] if hp.get("use_nesterov", False) else st["buf"]
            new[name] = p * (1 - lr * wd) - lr * u if decoupled else p - lr * u
        return new

    return step


SHAMPOO_CASES = [
    pytest.param({"learning_rate": 0.05, "max_preconditioner_dim": 10}, id="defaults"),
    pytest.param(
        {
            "learning_rate": 0.05,
            "betas": (0.9, 0.99),
            "momentum": 0.5,
            "use_nesterov": True,
            "weight_decay": 0.01,
            "max_preconditioner_dim": 10,
            "precondition_frequency": 3,
            "start_preconditioning_step": 6,
            "grafting": "adam",
            "grafting_beta2": 0.9,
            "precondition_1d": True,
        },
        id="adam-grafting-momentum-decoupled-decay",
    ),
    pytest.param(
        {
            "learning_rate": 0.1,
            "betas": (0.5, 0.95),
            "epsilon": 1e-6,
            "momentum": 0.3,
            "weight_decay": 0.05,
            "use_decoupled_weight_decay": False,
            "use_bias_correction": False,
            "max_preconditioner_dim": 10,
            "precondition_frequency": 2,
            "inv_root_override": 2,
            "grafting": "adagrad",
        },
        id="adagrad-grafting-l2-root-2",
    ),
]


@pytest.mark.parametrize("hp", SHAMPOO_CASES)
def test_shampoo_follows_its_equations(hp: dict) -> None:
    """15 float64 steps within 1e-12 of the documented update written out (measured 1e-14; a vector's rank-deficient
    statistics included: its preconditioner acts on the gradients' span only)."""
    worst, moved = _worst_error(fadam.shampoo(**hp), shampoo_reference(hp), SHAPES)
    assert worst <= 1e-12, worst
    assert moved > 0.05


# --------------------------------------------------------------------------------------- composition and inputs


ENSEMBLE = [
    pytest.param(lambda: fadam.soap(0.05, precondition_frequency=2, precondition_1d=True), id="soap"),
    pytest.param(
        lambda: fadam.shampoo(0.05, betas=(0.9, 0.99), grafting="adam", precondition_frequency=2), id="shampoo"
    ),
]


@pytest.mark.parametrize("make", ENSEMBLE)
def test_vmap_over_an_ensemble_equals_each_member_alone(make: Callable) -> None:
    """Three members stepped together by ``torch.func.vmap`` (which computes both outcomes of each refresh and
    selects) equal each member stepped alone (which computes only the refreshes it needs), within 1e-12."""
    shapes = {"matrix": (4, 5), "vector": (3,)}
    stacked, members = quadratic.ensemble_and_members(make(), shapes, steps=6)
    for i, params in enumerate(members):
        for k in shapes:
            torch.testing.assert_close(stacked[k][i], params[k], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("make", [fadam.soap, fadam.shampoo], ids=["soap", "shampoo"])
def test_16_bit_params_keep_float32_statistics(make: Callable) -> None:
    tx = make(learning_rate=0.05, precondition_frequency=2)
    shapes = {"matrix": (4, 5), "vector": (3,)}
    assert quadratic.float_state_dtypes_after_bfloat16_steps(tx, shapes, 4) == {torch.float32}


def test_partition_gives_each_leaf_its_transform() -> None:
    """SOAP on the matrices, AdamW on the rest: each leaf as its transform alone, bit for bit."""
    params = quadratic.start({"matrix": (4, 5), "cube": (2, 3, 4), "vector": (3,)})
    labels = {"matrix": "soap", "cube": "soap", "vector": "adamw"}
    tx = fadam.partition({"soap": fadam.soap(0.05, precondition_frequency=2), "adamw": fadam.adamw(0.01)}, labels)
    soap, adamw = fadam.soap(0.05, precondition_frequency=2), fadam.adamw(0.01)
    matrices, vectors = {k: params[k] for k in ("matrix", "cube")}, {"vector": params["vector"]}
    state, soap_state, adamw_state = tx.init(params), soap.init(matrices), adamw.init(vectors)
    for t in range(1, 6):
        grads = {k: quadratic.gradient(k, p, t) for k, p in params.items()}
        params, state = fadam.step(tx, params, grads, state)
        matrices, soap_state = fadam.step(soap, matrices, {k: grads[k] for k in matrices}, soap_state)
        vectors, adamw_state = fadam.step(adamw, vectors, {"vector": grads["vector"]}, adamw_state)
    assert all(torch.equal(params[k], v) for k, v in {**matrices, **vectors}.items())


@pytest.mark.parametrize("factory", [fadam.scale_by_soap, fadam.scale_by_shampoo])
def test_init_refuses_complex_params(factory: Callable) -> None:
    with pytest.raises(ValueError, match=r"real params only: param \['z'\] is torch.complex64"):
        factory().init({"w": torch.zeros(2, 2), "z": torch.zeros(3, dtype=torch.complex64)})


DTENSOR_CASES = [
    pytest.param(lambda: fadam.soap(0.05, precondition_frequency=2, precondition_1d=True), id="soap"),
    pytest.param(lambda: fadam.shampoo(0.05, grafting="adam", precondition_1d=True), id="shampoo"),
    pytest.param(lambda: fadam.psgd_kron(0.05), id="psgd-kron"),
]


@pytest.mark.parametrize("make", DTENSOR_CASES)
def test_dtensor_params_keep_replicated_state_that_round_trips_through_dcp(make: Callable, tmp_path: Path) -> None:
    """On a one-rank mesh (tests/test_fsdp.py runs two ranks): the state of DTensor params is replicated, the updates
    have the params' placements, the params are a plain run's bit for bit, and the state saved by
    torch.distributed.checkpoint loads into a fresh state that steps on alike."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        plain = quadratic.start({"matrix": (4, 3), "vector": (3,)})
        tx = make()
        params, state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in plain.items()}, tx.init(plain)
        sharded_state = tx.init(params)
        for t in range(1, 4):
            grads = {k: quadratic.gradient(k, p, t) for k, p in plain.items()}
            plain, state = fadam.step(tx, plain, grads, state)
            updates, sharded_state = tx.update(
                {k: distribute_tensor(g, mesh, [Shard(0)]) for k, g in grads.items()}, sharded_state, params
            )
            assert all(u.placements == (Shard(0),) for u in updates.values())
            params = fadam.apply_updates(params, updates)
        assert all(torch.equal(params[k].full_tensor(), plain[k]) for k in plain)
        matrices = [x for x in fadam._tree.tree_leaves(sharded_state) if x.dim() > 0]
        assert matrices and all(isinstance(x, DTensor) and x.placements == (Replicate(),) for x in matrices)
        dcp.save({"optim": fadam.state_to_dict(sharded_state)}, checkpoint_id=tmp_path / "ckpt")
        target = {"optim": fadam.state_to_dict(tx.init(params))}
        dcp.load(target, checkpoint_id=tmp_path / "ckpt")
        loaded = fadam.state_from_dict(sharded_state, target["optim"])
        grads = {k: distribute_tensor(quadratic.gradient(k, p, 4), mesh, [Shard(0)]) for k, p in plain.items()}
        after, after_loaded = (fadam.step(tx, params, grads, s)[0] for s in (sharded_state, loaded))
        assert all(torch.equal(after[k].full_tensor(), after_loaded[k].full_tensor()) for k in after)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: fadam.soap(precondition_frequency=0), "Invalid precondition_frequency: 0"),
        (lambda: fadam.soap(max_precond_dim=2.5), "Invalid max_precond_dim: 2.5"),
        (lambda: fadam.soap(betas=(1.0, 0.9)), "Invalid beta1: 1.0"),
        (lambda: fadam.soap(shampoo_beta=1.5), "Invalid shampoo_beta: 1.5"),
        (lambda: fadam.soap(data_format="nhwc"), "Invalid data_format: 'nhwc'"),
        (lambda: fadam.soap(weight_decay=-0.1), "Invalid weight_decay value: -0.1"),
        (lambda: fadam.scale_by_soap(statistics_dtype=torch.float16), "Invalid statistics_dtype"),
        (lambda: fadam.shampoo(betas=(0.9, 0.0)), "Invalid b2: 0.0"),
        (lambda: fadam.shampoo(grafting="sgd"), "Invalid grafting: 'sgd'"),
        (lambda: fadam.shampoo(precondition_frequency=4, start_preconditioning_step=2), "expected -1 or an int >= "),
        (lambda: fadam.shampoo(inv_root_override=-1), "Invalid inv_root_override: -1"),
        (lambda: fadam.shampoo(learning_rate=-1.0), "Invalid learning rate: -1.0"),
    ],
)
def test_bad_hyperparameters_are_refused(make: Callable, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_shampoo_without_grafting_compiles_into_one_graph() -> None:
    """The battery's Shampoo row grafts Adam; without grafting the state keeps an empty tuple per leaf, which the
    step carries over as it is: one graph for every step (refreshes and the switch selected in the graph), the eager
    numbers."""
    from torch._dynamo.testing import CompileCounter

    tx = fadam.shampoo(0.05, precondition_frequency=2, start_preconditioning_step=2, grafting=None)
    start = quadratic.start({"matrix": (4, 5), "vector": (3,)})
    torch.compiler.reset()
    counter = CompileCounter()

    @torch.compile(backend=counter, fullgraph=True)
    def train_step(params: dict, grads: dict, state: Any) -> tuple[dict, Any]:
        updates, state = tx.update(grads, state, params)
        return fadam.apply_updates(params, updates), state

    compiled, compiled_state, eager, eager_state = start, tx.init(start), start, tx.init(start)
    for t in range(1, 6):
        grads = {k: quadratic.gradient(k, p, t) for k, p in compiled.items()}
        compiled, compiled_state = train_step(compiled, grads, compiled_state)
        eager, eager_state = fadam.step(tx, eager, grads, eager_state)
    assert counter.frame_count == 1
    for k in start:
        torch.testing.assert_close(compiled[k], eager[k], rtol=1e-12, atol=1e-12)
