"""fadam.Optimizer where torch.optim.Optimizer's own API is used: the state_dict, load_state_dict and step hooks, each
run side by side with a torch.optim optimizer doing the same."""

from __future__ import annotations

import copy
import functools
import io
import pickle
from collections.abc import Callable

import optree
import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import fadam


def _pair(lr: float = 0.1) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """A fadam.Optimizer and a torch.optim.SGD, each over its own copy of the same two params."""
    torch.manual_seed(0)
    values = [torch.randn(3), torch.randn(2)]
    ours = fadam.Optimizer([torch.nn.Parameter(v.clone()) for v in values], fadam.sgd, lr=lr)
    theirs = torch.optim.SGD([torch.nn.Parameter(v.clone()) for v in values], lr=lr)
    return ours, theirs


def _give_grads(opt: torch.optim.Optimizer) -> None:
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)


def _both(run: Callable[[torch.optim.Optimizer], list]) -> list:
    """What ``run`` logs on the fadam optimizer, checked equal to what it logs on the torch one."""
    ours, theirs = _pair()
    logged = run(ours)
    assert logged == run(theirs)
    return logged


def test_state_dict_hooks_run_in_torchs_order_and_a_post_hook_replaces_the_result():
    def run(opt: torch.optim.Optimizer) -> list:
        log: list = []
        opt.register_state_dict_pre_hook(lambda o: log.append(("pre a", o is opt)))
        opt.register_state_dict_pre_hook(lambda o: log.append(("pre b", o is opt)), prepend=True)
        removed = opt.register_state_dict_pre_hook(lambda o: log.append("removed"))
        removed.remove()
        opt.register_state_dict_post_hook(lambda o, sd: log.append(("post a", sorted(sd))))
        opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 1}, prepend=True)
        opt.register_state_dict_post_hook(lambda o, sd: log.append(("post c", sd.get("extra"))))
        log.append(("returned", opt.state_dict()["extra"]))
        return log

    assert _both(run) == [
        ("pre b", True),
        ("pre a", True),
        ("post a", ["extra", "param_groups", "state"]),
        ("post c", 1),
        ("returned", 1),
    ]


def test_load_state_dict_hooks_see_a_copy_may_replace_it_and_run_after_loading():
    def run(opt: torch.optim.Optimizer) -> list:
        log: list = []
        _give_grads(opt)
        opt.step()
        saved = opt.state_dict()

        def replace(o: torch.optim.Optimizer, sd: dict) -> dict:
            log.append(("pre", sd is saved, sorted(sd)))
            sd["ignored"] = True  # a shallow copy: the caller's dict keeps its keys
            return {"state": sd["state"], "param_groups": [{**g, "lr": 0.5} for g in sd["param_groups"]]}

        opt.register_load_state_dict_pre_hook(lambda o, sd: log.append("first"))
        opt.register_load_state_dict_pre_hook(replace)
        opt.register_load_state_dict_pre_hook(lambda o, sd: log.append("prepended"), prepend=True)
        opt.register_load_state_dict_post_hook(lambda o: log.append(("post", o.param_groups[0]["lr"])))
        opt.register_load_state_dict_post_hook(lambda o: log.append("post first"), prepend=True)
        opt.load_state_dict(saved)
        log.append(("caller's keys", sorted(saved)))
        return log

    assert _both(run) == [
        "prepended",
        "first",
        ("pre", False, ["param_groups", "state"]),
        "post first",
        ("post", 0.5),
        ("caller's keys", ["param_groups", "state"]),
    ]


def test_load_state_dict_loads_what_a_pre_hook_returns():
    ours, _ = _pair()
    saved = ours.state_dict()  # SGD's: no Adam moments
    adam = fadam.Optimizer([torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))], fadam.adam, lr=1)
    with pytest.raises(ValueError, match="state_dict holds"):
        adam.load_state_dict(saved)
    own = adam.state_dict()
    own["param_groups"][0]["lr"] = 0.25
    adam.register_load_state_dict_pre_hook(lambda o, sd: own)
    adam.load_state_dict(saved)
    assert adam.param_groups[0]["lr"] == 0.25


def test_step_hooks_and_the_global_step_hooks_run_as_for_torch():
    def run(opt: torch.optim.Optimizer) -> list:
        log: list = []
        _give_grads(opt)
        handles = [
            register_optimizer_step_pre_hook(lambda o, a, k: log.append("global pre")),
            register_optimizer_step_post_hook(lambda o, a, k: log.append("global post")),
        ]
        try:
            opt.register_step_pre_hook(lambda o, args, kwargs: log.append(("pre", o is opt, len(args))))
            # a pre-hook may replace the arguments: here the closure, whose loss step() returns
            opt.register_step_pre_hook(lambda o, args, kwargs: ((o,), {"closure": lambda: 42.0}))
            opt.register_step_post_hook(lambda o, args, kwargs: log.append(("post", sorted(kwargs))))
            log.append(("loss", opt.step()))
            log.append(("moved", float(opt.param_groups[0]["params"][1].detach()[0])))
        finally:
            for handle in handles:
                handle.remove()
        return log

    logged = _both(run)
    assert logged[:4] == ["global pre", ("pre", True, 1), ("post", ["closure"]), "global post"]
    assert logged[4] == ("loss", 42.0)


# --- state_dict numbering -----------------------------------------------------------------------------------------


def _params(count: int) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.full((k + 1,), float(k + 1))) for k in range(count)]


def _groups(ps: list[torch.nn.Parameter], layout: list[list[int]], named: bool) -> list[dict]:
    """Param groups listing ``ps[k]`` for each ``k`` of each inner list (a param listed twice in a group included)."""
    return [{"params": [(f"p{k}", ps[k]) if named else ps[k] for k in ks]} for ks in layout]


LAYOUTS = {
    "one group": [[0, 1, 2]],
    "sizes 1, 3, 2": [[2], [0, 3, 1], [5, 4]],
    "listed twice": [[0, 1, 0], [2, 3]],
    "twice in a later group": [[4], [0, 3, 0, 1], [2]],
    "three times": [[1, 1, 1], [0]],
}


@pytest.mark.filterwarnings("ignore:.*duplicate parameters")
@pytest.mark.parametrize("named", [False, True], ids=["unnamed", "named"])
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_state_dict_numbers_params_as_torch_does(layout, named):
    ps = _params(6)
    ours = fadam.Optimizer(_groups(ps, layout, named), functools.partial(fadam.sgd, momentum=0.9), lr=0.1)
    theirs = torch.optim.SGD(_groups(ps, layout, named), lr=0.1, momentum=0.9)
    for p in ps:
        p.grad = torch.ones_like(p)
    ours.step()
    theirs.step()  # steps a param listed twice twice: only the state's keys are compared
    mine, torchs = ours.state_dict(), theirs.state_dict()
    for group, reference in zip(mine["param_groups"], torchs["param_groups"]):
        assert group["params"] == reference["params"]
        assert group.get("param_names") == reference.get("param_names")
    assert sorted(mine["state"]) == sorted(torchs["state"])
    for number, entry in mine["state"].items():  # each number holds the state of the param torch gives it
        assert entry["state[0].trace"].shape == torchs["state"][number]["momentum_buffer"].shape


@pytest.mark.filterwarnings("ignore:.*duplicate parameters")
def test_a_torch_state_dict_of_a_group_listing_a_param_twice_loads():
    ps = _params(4)
    layout = [[0, 1, 0], [3, 2]]
    reference = torch.optim.Adam(_groups(ps, layout, False), lr=0.1)
    reference.param_groups[0]["params"] = [ps[0], ps[1]]  # stepped once, as fadam steps it
    for p in ps:
        p.grad = torch.arange(p.numel(), dtype=p.dtype) + 1.0
    reference.step()
    reference.param_groups[0]["params"] = [ps[0], ps[1], ps[0]]
    ours = fadam.Optimizer(_groups(ps, layout, False), fadam.adam, lr=0.5)
    ours.load_state_dict(reference.state_dict())
    assert ours.param_groups[0]["lr"] == 0.1
    for group, tx_state in zip(ours.param_groups, ours.tx_states):
        for p, mu in zip(group["params"], tx_state[0].mu):
            assert torch.equal(mu, reference.state[p]["exp_avg"])


def test_one_name_for_two_params_is_refused_and_a_named_entry_listed_twice_is_one_param():
    ps = _params(2)
    with pytest.raises(ValueError, match=r"param group 0: param names in a group must be unique, got \['a', 'a'\]"):
        fadam.Optimizer([("a", ps[0]), ("a", ps[1])], fadam.sgd, lr=0.1)
    with pytest.warns(UserWarning, match="duplicate parameters"):
        opt = fadam.Optimizer([("a", ps[0]), ("b", ps[1]), ("a", ps[0])], fadam.sgd, lr=0.1)
    assert opt.param_groups[0]["params"] == ps and opt.param_groups[0]["param_names"] == ["a", "b"]


# --- copy.deepcopy and pickle -------------------------------------------------------------------------------------


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 2, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _leaves(opt: fadam.Optimizer) -> list[torch.Tensor]:
    return [leaf for leaf in optree.tree_leaves(opt.tx_states) if isinstance(leaf, torch.Tensor)]


MODES = {
    "factory": lambda ps: fadam.Optimizer(ps, functools.partial(fadam.adamw, weight_decay=0.1), lr=1e-2),
    "injected": lambda ps: fadam.Optimizer(ps, fadam.inject_hyperparams(fadam.adam)(lr=1e-2)),
    "ready": lambda ps: fadam.Optimizer(ps, fadam.adam(lr=1e-2), lr=1e-2),
}


@pytest.mark.parametrize("make", MODES.values(), ids=MODES.keys())
def test_deepcopy_with_the_model_is_independent_and_follows_the_same_trajectory(make):
    model = _model()
    opt = make(model.parameters())
    _train(model, opt, 3)
    twin_model, twin = copy.deepcopy((model, opt))
    assert all(p is q for p, q in zip(twin.param_groups[0]["params"], twin_model.parameters()))
    storages = {leaf.untyped_storage().data_ptr() for leaf in _leaves(opt)}
    assert not storages & {leaf.untyped_storage().data_ptr() for leaf in _leaves(twin)}
    before = [leaf.clone() for leaf in _leaves(opt)]
    _train(twin_model, twin, 4, start=3)
    assert all(torch.equal(a, b) for a, b in zip(_leaves(opt), before))  # the original's state is untouched
    _train(model, opt, 4, start=3)
    for p, q in zip(model.parameters(), twin_model.parameters()):
        assert torch.equal(p, q)
    assert all(torch.equal(a, b) for a, b in zip(_leaves(opt), _leaves(twin)))


@pytest.mark.parametrize("make", MODES.values(), ids=MODES.keys())
def test_a_deep_copy_steps_with_its_own_groups_lr(make):
    model = _model()
    opt = make(model.parameters())
    twin_model, twin = copy.deepcopy((model, opt))
    twin.param_groups[0]["lr"] = 0.0  # a factory's transform must read the copy's group, not the original's
    frozen = [p.detach().clone() for p in twin_model.parameters()]
    start = [p.detach().clone() for p in model.parameters()]
    _train(twin_model, twin, 2)
    _train(model, opt, 2)
    assert all(torch.equal(p, q) for p, q in zip(twin_model.parameters(), frozen))
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), start))


def test_deepcopy_of_the_optimizer_alone_copies_its_params_as_torch_does():
    ours, theirs = _pair()
    log: list = []
    for opt in (ours, theirs):
        opt.register_state_dict_pre_hook(lambda o: log.append(type(o).__name__))
    copies = copy.deepcopy(ours), copy.deepcopy(theirs)
    for original, twin in zip((ours, theirs), copies):
        for p, q in zip(original.param_groups[0]["params"], twin.param_groups[0]["params"]):
            assert p is not q and torch.equal(p, q)
        twin.state_dict()  # hooks are not copied, by torch.optim either
    assert log == []
    _give_grads(copies[0])
    copies[0].step()
    assert not torch.equal(copies[0].param_groups[0]["params"][0], ours.param_groups[0]["params"][0])


def test_pickle_carries_an_optimizer_built_from_picklable_factories():
    model = _model()
    head = {"params": model[2].parameters(), "tx": functools.partial(fadam.sgd, momentum=0.9)}
    opt = fadam.Optimizer([{"params": model[0].parameters()}, head], fadam.adam, lr=1e-2)
    _train(model, opt, 3)
    twin_model, twin = pickle.loads(pickle.dumps((model, opt)))
    twin.param_groups[1]["lr"] = opt.param_groups[1]["lr"] = 0.05
    _train(model, opt, 3, start=3)
    _train(twin_model, twin, 3, start=3)
    for p, q in zip(model.parameters(), twin_model.parameters()):
        assert torch.equal(p, q)
    assert int(twin.tx_states[0][0].count) == 6


def _with_own_injected_group(ps: list[torch.nn.Parameter]) -> fadam.Optimizer:
    own = {"params": ps[1:], "tx": fadam.inject_hyperparams(fadam.sgd)(lr=0.1)}
    return fadam.Optimizer([{"params": ps[:1]}, own], fadam.sgd, lr=0.1)


@pytest.mark.parametrize(
    ("make", "where"),
    [
        (lambda ps: fadam.Optimizer(ps, fadam.adam(lr=0.1), lr=0.1), "its tx does not pickle"),
        (lambda ps: fadam.Optimizer(ps, lambda lr: fadam.sgd(lr), lr=0.1), "its tx does not pickle"),
        (_with_own_injected_group, "its param group 1's tx does not pickle"),
    ],
    ids=["ready", "lambda-factory", "a-groups-own"],
)
def test_pickling_a_transform_that_does_not_pickle_fails_at_dumps_saying_what_to_do(make, where):
    opt = make(list(_model().parameters()))
    with pytest.raises(pickle.PicklingError, match=rf"^cannot pickle this fadam\.Optimizer: {where} .*state_dict\(\)"):
        pickle.dumps(opt)
    with pytest.raises(pickle.PicklingError, match=r"^cannot pickle this fadam\.Optimizer"):
        torch.save(opt, io.BytesIO())
