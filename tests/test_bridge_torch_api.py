"""fadam.Optimizer where torch.optim.Optimizer's own API is used: the state_dict, load_state_dict and step hooks, each
run side by side with a torch.optim optimizer doing the same."""

from __future__ import annotations

from collections.abc import Callable

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
