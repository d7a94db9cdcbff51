"""Muon: ``fadam.muon`` against torch.optim.Muon (2-D params only, so not in the conformance battery, whose trees hold
vectors; the battery runs ``muon_with_adamw``), the Muon + AdamW recipe on a module, DTensor params, bad input."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import fadam
from tests.tree_checks import max_rel_err

SHAPES = {"wide": (4, 9), "tall": (12, 5), "square": (6, 6)}
VARIANTS = [
    pytest.param({"lr": 0.02}, id="defaults-nesterov-wd"),
    pytest.param({"lr": 0.02, "nesterov": False, "weight_decay": 0.0}, id="heavy-ball-no-wd"),
    pytest.param({"lr": 0.05, "weight_decay": 0.3, "adjust_lr_fn": "match_rms_adamw"}, id="moonlight-wd"),
    pytest.param({"lr": 0.01, "momentum": 0.9, "nesterov": False, "ns_steps": 3}, id="momentum-3-steps"),
]


def _problem(dtype: torch.dtype) -> tuple[dict, dict, torch.Generator]:
    gen = torch.Generator().manual_seed(0)
    params = {k: torch.randn(s, generator=gen, dtype=dtype) for k, s in SHAPES.items()}
    targets = {k: torch.randn(s, generator=gen, dtype=dtype) for k, s in SHAPES.items()}
    return params, targets, gen


@pytest.mark.parametrize("kwargs", VARIANTS)
def test_float64_trajectory_equals_torch_muon(kwargs: dict) -> None:
    """300 steps on a quadratic with noise (the gradients follow the params), through ``update`` + ``apply_updates``
    and through ``fadam.step``: every param within 1e-12 of torch.optim.Muon (measured 6.7e-16), and the momentum
    equals torch's momentum buffer."""
    params, targets, gen = _problem(torch.float64)
    start = {k: v.clone() for k, v in params.items()}
    ref = {k: v.clone() for k, v in params.items()}
    opt = torch.optim.Muon(list(ref.values()), **kwargs)
    tx = fadam.muon(**kwargs)
    runs = {"update": (params, tx.init(params)), "step": (params, tx.init(params))}
    worst = 0.0
    for _ in range(300):
        noise = {k: torch.randn(s, generator=gen, dtype=torch.float64) for k, s in SHAPES.items()}
        for k, p in ref.items():
            p.grad = p - targets[k] + noise[k]
        opt.step()
        p, s = runs["update"]
        updates, s = tx.update({k: p[k] - targets[k] + noise[k] for k in p}, s, p)
        runs["update"] = (fadam.apply_updates(p, updates), s)
        p, s = runs["step"]
        runs["step"] = fadam.step(tx, p, {k: p[k] - targets[k] + noise[k] for k in p}, s)
        for p, _ in runs.values():
            worst = max(worst, max(float((p[k] - ref[k]).abs().max()) for k in ref))
    assert worst <= 1e-12
    assert min(float((ref[k] - start[k]).abs().max()) for k in ref) > 0.1  # the trajectories went somewhere
    for _, state in runs.values():
        for k, p in ref.items():
            torch.testing.assert_close(state[0][0].mu[k], opt.state[p]["momentum_buffer"], rtol=0, atol=1e-12)


def test_fadam_optimizer_is_a_drop_in_for_torch_muon() -> None:
    """``fadam.Optimizer(params, fadam.muon, ...)`` steps a module's matrices as torch.optim.Muon does."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10, bias=False), torch.nn.Tanh(), torch.nn.Linear(10, 3, bias=False))
    model = model.double()
    twin = copy.deepcopy(model)
    ours = fadam.Optimizer(model.parameters(), fadam.muon, lr=0.03, weight_decay=0.05)
    theirs = torch.optim.Muon(twin.parameters(), lr=0.03, weight_decay=0.05)
    x, y = torch.randn(32, 6, dtype=torch.float64), torch.randn(32, 3, dtype=torch.float64)
    for _ in range(50):
        for net, opt in ((model, ours), (twin, theirs)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
    err, where = max_rel_err(list(model.parameters()), list(twin.parameters()))
    assert err <= 1e-12, where


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(12, 8)
        self.hidden = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.mix = torch.nn.Linear(16, 8)
        self.head = torch.nn.Linear(8, 12)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.mix(self.norm(torch.relu(self.hidden(self.embed(tokens))))))


def _loss(params: dict, net: torch.nn.Module, tokens: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(torch.func.functional_call(net, params, (tokens,)), target)


def test_muon_with_adamw_equals_torch_muon_and_adamw_on_a_module() -> None:
    """Labels: the hidden matrices take Muon, the embedding and head (named by ``adamw_for``), biases and the norm
    AdamW; 100 float64 steps on a language-model loss equal torch.optim.Muon plus torch.optim.AdamW over that split."""
    torch.manual_seed(0)
    net = _Net().double()
    params = {k: v.detach().clone() for k, v in net.named_parameters()}

    def adamw_for(path: str, p: torch.Tensor) -> bool:
        return "embed" in path or "head" in path

    labels = fadam.muon_labels(params, adamw_for)
    assert [k for k, label in labels.items() if label == "muon"] == ["hidden.weight", "mix.weight"]
    muon_kw = {"lr": 0.02, "weight_decay": 0.01, "adjust_lr_fn": "original"}
    adamw_kw = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}
    tx = fadam.muon_with_adamw(**muon_kw, **{f"adamw_{k}": v for k, v in adamw_kw.items()}, adamw_for=adamw_for)
    named = dict(net.named_parameters())
    opts = [
        torch.optim.Muon([named[k] for k in labels if labels[k] == "muon"], **muon_kw),
        torch.optim.AdamW([named[k] for k in labels if labels[k] == "adamw"], foreach=False, **adamw_kw),
    ]
    state = tx.init(params)
    gen = torch.Generator().manual_seed(1)
    for _ in range(100):
        tokens = torch.randint(0, 12, (24,), generator=gen)
        target = torch.randint(0, 12, (24,), generator=gen)
        for opt in opts:
            opt.zero_grad()
        torch.nn.functional.cross_entropy(net(tokens), target).backward()
        for opt in opts:
            opt.step()
        grads = torch.func.grad(_loss)(params, net, tokens, target)
        params, state = fadam.step(tx, params, grads, state)
    err, where = max_rel_err(params, {k: v.detach() for k, v in net.named_parameters()})
    assert err <= 1e-12, f"{err:.2e} at {where}"


def test_bfloat16_momentum_is_kept_without_nesterov() -> None:
    """torch.optim.Muon with bfloat16 params and ``nesterov=False`` normalises its momentum buffer in place (the
    orthogonalisation's first division runs on the buffer itself); fadam keeps the momentum: (1 - 0.5) * 8 = 4."""
    tx = fadam.muon(lr=0.0, weight_decay=0.0, momentum=0.5, nesterov=False)
    params = {"w": torch.zeros(4, 3, dtype=torch.bfloat16)}
    _, state = tx.update({"w": torch.full((4, 3), 8.0, dtype=torch.bfloat16)}, tx.init(params), params)
    assert torch.equal(state[0][0].mu["w"], torch.full((4, 3), 4.0, dtype=torch.bfloat16))


def test_orthogonalisation_moves_singular_values_near_one() -> None:
    g = torch.randn(16, 40, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 7.0
    u = fadam.transforms._muon.newton_schulz(g, fadam.transforms._muon.NS_COEFFICIENTS, 5, 1e-7)
    singular = torch.linalg.svdvals(u.double())
    assert u.dtype == torch.bfloat16 and float(singular.min()) > 0.6 and float(singular.max()) < 1.3


def test_the_momentum_runs_in_the_generated_kernel_and_the_orthogonalisation_eagerly() -> None:
    lines = fadam.explain(fadam.muon(), {"w": torch.zeros(3, 4)}).splitlines()
    assert lines[0] == "scale_by_muon: generated CPU kernel: ['w']"
    assert lines[1] == "_orthogonalise (state at [0, 1]): eager (an opaque transform): all 1 leaves"
    assert lines[2] == "scale_by_learning_rate -> add_decoupled_weight_decay: generated CPU kernel: ['w']"


def test_a_masked_opaque_stage_leaves_the_other_leaves_alone_in_a_step() -> None:
    """``fadam.step`` runs an opaque member of a masked chain on the selected leaves only, as ``update`` does."""
    opaque = fadam.stateless(lambda updates, params: fadam.tree_scale(updates, 100.0))
    tx = fadam.partition({"x": fadam.chain(fadam.scale(2.0), opaque), "y": fadam.scale(3.0)}, {"a": "x", "b": "y"})
    params = {"a": torch.ones(3), "b": torch.ones(3)}
    stepped, _ = fadam.step(tx, params, params, tx.init(params))
    assert torch.equal(stepped["a"], torch.full((3,), 201.0)) and torch.equal(stepped["b"], torch.full((3,), 4.0))


@pytest.mark.parametrize(
    ("leaf", "message"),
    [
        (torch.zeros(3), r"2-D matrices only: param \['b'\] has shape \(3,\)"),
        (torch.zeros(2, 2, 2), r"2-D matrices only: param \['b'\] has shape \(2, 2, 2\)"),
        (torch.zeros(2, 2, dtype=torch.complex64), r"real matrices only: param \['b'\] is torch.complex64"),
    ],
)
def test_init_refuses_what_muon_cannot_orthogonalise(leaf: torch.Tensor, message: str) -> None:
    for tx in (fadam.muon(), fadam.scale_by_muon()):
        with pytest.raises(ValueError, match=message):
            tx.init({"a": torch.zeros(2, 2), "b": leaf})


def test_update_refuses_a_vector_before_computing_anything() -> None:
    tx = fadam.transforms._muon._orthogonalise((3.4445, -4.775, 2.0315), 5, 1e-7, None)
    with pytest.raises(ValueError, match=r"the update at \['v'\] has shape \(5,\)"):
        tx.update({"m": torch.ones(2, 2), "v": torch.ones(5)}, tx.init(None))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -1.0}, "Invalid learning rate"),
        ({"weight_decay": -0.1}, "Invalid weight_decay"),
        ({"momentum": -0.5}, "Invalid momentum"),
        ({"ns_steps": 100}, "Invalid ns_steps"),
        ({"ns_coefficients": (1.0, 2.0)}, "ns_coefficients must be 3 numbers"),
        ({"adjust_lr_fn": "rms"}, "Invalid adjust_lr_fn"),
    ],
)
def test_bad_hyperparameters_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fadam.muon(**kwargs)


def test_dtensor_params_give_the_plain_numbers(tmp_path: Path) -> None:
    """A gloo mesh of one rank in this process, matrices sharded along dim 0 and dim 1 (and a replicated vector for
    AdamW): ``update`` and ``fadam.step(donate=True)`` on DTensors equal plain tensors bit for bit, and the state keeps
    the params' placements. Two ranks (shards that are not the whole matrix) run in tests/test_fsdp.py, whose worker
    trains every conformance row, ``muon-with-adamw`` included, under ``fully_shard``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    gen = torch.Generator().manual_seed(0)
    plain = {"tall": torch.randn(12, 5, generator=gen), "wide": torch.randn(4, 9, generator=gen)}
    plain["bias"] = torch.randn(7, generator=gen)
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in plain.items()} for _ in range(6)]
    start = {k: v.clone() for k, v in plain.items()}
    tx = fadam.muon_with_adamw(lr=0.02, adamw_lr=1e-2)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        placements = {"tall": [Shard(0)], "wide": [Shard(1)], "bias": [Replicate()]}
        sharded = {k: distribute_tensor(v.clone(), mesh, placements[k]) for k, v in plain.items()}
        state, plain_state = tx.init(sharded), tx.init(plain)
        mu = state.inner_states["muon"].inner_state[0][0].mu
        assert mu["tall"].placements == (Shard(0),) and mu["wide"].placements == (Shard(1),)
        for index, g in enumerate(grads):
            sharded_g = {k: distribute_tensor(v, mesh, placements[k]) for k, v in g.items()}
            if index % 2:
                sharded, state = fadam.step(tx, sharded, sharded_g, state, donate=True)
            else:
                updates, state = tx.update(sharded_g, state, sharded)
                sharded = fadam.apply_updates(sharded, updates)
            plain, plain_state = fadam.step(tx, plain, g, plain_state)
        for k, v in plain.items():
            assert sharded[k].placements == tuple(placements[k])
            assert torch.equal(sharded[k].full_tensor(), v), k
        assert all(float((plain[k] - start[k]).abs().max()) > 1e-2 for k in plain)
    finally:
        dist.destroy_process_group()
