"""``chain``, ``named_chain``, ``masked`` and ``partition``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fadam
from tests.tree_checks import max_rel_err, tensor_leaves


def _params() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    return {
        "encoder": {
            "w": torch.randn(3, 2, generator=gen, dtype=torch.float64),
            "b": torch.zeros(2, dtype=torch.float64),
        },
        "head": {"w": torch.randn(2, generator=gen, dtype=torch.float64)},
    }


def _grads(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return fadam.tree_map(lambda p: torch.randn(p.shape, generator=gen, dtype=p.dtype), _params())


def _recorder(name: str, log: list) -> fadam.GradientTransformation:
    def update(updates, state, params=None, **extra):
        log.append((name, dict(extra)))
        return updates, state

    return fadam.GradientTransformation(lambda params: fadam.EmptyState(), update)


# ------------------------------------------------------------------------------------------------------------ chain


def test_chain_applies_in_order():
    g = [torch.tensor([3.0, -0.5])]
    clip_then_scale, _ = fadam.chain(fadam.clip(1.0), fadam.scale(2.0)).update(g, ((), ()))
    scale_then_clip, _ = fadam.chain(fadam.scale(2.0), fadam.clip(1.0)).update(g, ((), ()))
    assert clip_then_scale[0].tolist() == [2.0, -1.0]
    assert scale_then_clip[0].tolist() == [1.0, -1.0]


def test_chain_state_is_tuple_of_member_states():
    tx = fadam.chain(fadam.trace(0.9), fadam.scale_by_adam(), fadam.scale(-1.0))
    state = tx.init(_params())
    assert isinstance(state, tuple) and len(state) == 3
    assert isinstance(state[0], fadam.TraceState) and isinstance(state[1], fadam.ScaleByAdamState)
    assert state[2] == fadam.EmptyState()
    with pytest.raises(ValueError, match="chain of 3 transforms"):
        tx.update(_grads(1), state[:2])


def test_chain_equals_manual_composition():
    a, b = fadam.trace(0.5), fadam.scale_by_adam()
    tx = fadam.chain(a, b)
    params = _params()
    state, sa, sb = tx.init(params), a.init(params), b.init(params)
    for seed in range(3):
        g = _grads(seed)
        out, state = tx.update(g, state, params)
        manual, sa = a.update(g, sa, params)
        manual, sb = b.update(manual, sb, params)
        assert max_rel_err(out, manual)[0] == 0.0


def test_extra_args_reach_every_member():
    log: list = []
    tx = fadam.chain(_recorder("a", log), fadam.scale(1.0), _recorder("b", log))
    tx.update(_grads(0), tx.init(_params()), _params(), loss=1.5, key="x")
    assert log == [("a", {"loss": 1.5, "key": "x"}), ("b", {"loss": 1.5, "key": "x"})]
    log.clear()
    named = fadam.named_chain(("first", _recorder("a", log)), ("second", _recorder("b", log)))
    named.update(_grads(0), named.init(_params()), loss=2.0)
    assert log == [("a", {"loss": 2.0}), ("b", {"loss": 2.0})]


def test_named_chain_state_by_name_and_same_numbers_as_chain():
    named = fadam.named_chain(("momentum", fadam.trace(0.9)), ("lr", fadam.scale_by_learning_rate(0.1)))
    plain = fadam.chain(fadam.trace(0.9), fadam.scale_by_learning_rate(0.1))
    params = _params()
    sn, sp = named.init(params), plain.init(params)
    assert list(sn) == ["momentum", "lr"] and isinstance(sn["momentum"], fadam.TraceState)
    for seed in range(3):
        un, sn = named.update(_grads(seed), sn, params)
        up, sp = plain.update(_grads(seed), sp, params)
        assert max_rel_err(un, up)[0] == 0.0
    assert torch.equal(sn["momentum"].trace["head"]["w"], sp[0].trace["head"]["w"])


def test_named_chain_rejects_duplicate_names():
    with pytest.raises(ValueError, match="unique"):
        fadam.named_chain(("a", fadam.identity()), ("a", fadam.identity()))


# ----------------------------------------------------------------------------------------------------------- masked


MASKS = {
    "bool-tree": {"encoder": {"w": True, "b": False}, "head": {"w": True}},
    "prefix": {"encoder": True, "head": False},
    "callable": lambda params: fadam.tree_map(lambda p: p.ndim == 2, params),
}


def _selected(mask_name: str) -> dict[str, bool]:
    return {
        "bool-tree": {"['encoder']['w']": True, "['encoder']['b']": False, "['head']['w']": True},
        "prefix": {"['encoder']['w']": True, "['encoder']['b']": True, "['head']['w']": False},
        "callable": {"['encoder']['w']": True, "['encoder']['b']": False, "['head']['w']": False},
    }[mask_name]


@pytest.mark.parametrize("mask_name", list(MASKS))
def test_masked_applies_inner_to_selected_leaves_only(mask_name):
    inner = fadam.chain(fadam.scale_by_adam(), fadam.scale(-0.1))
    tx = fadam.masked(inner, MASKS[mask_name])
    params = _params()
    state = tx.init(params)
    selected = _selected(mask_name)
    # the inner state exists only for selected leaves
    mu_paths = [path for path, _ in tensor_leaves(state.inner_state[0].mu)]
    assert mu_paths == [path for path, keep in sorted(selected.items()) if keep]
    # selected leaves get exactly what the inner transform gives on them; the others pass through as they are
    sub_params = {path: t for path, t in tensor_leaves(params) if selected[path]}
    sub_state = inner.init(sub_params)
    for seed in range(3):
        g = _grads(seed)
        out, state = tx.update(g, state, params)
        sub_g = {path: t for path, t in tensor_leaves(g) if selected[path]}
        sub_out, sub_state = inner.update(sub_g, sub_state, sub_params)
        for (path, u), (_, original) in zip(tensor_leaves(out), tensor_leaves(g)):
            if selected[path]:
                assert torch.equal(u, sub_out[path]), path
            else:
                assert u is original, path


def test_masked_without_params_reads_mask_from_updates():
    tx = fadam.masked(fadam.scale(0.0), MASKS["callable"])
    out, _ = tx.update(_grads(0), tx.init(_params()))
    assert torch.equal(out["encoder"]["w"], torch.zeros(3, 2, dtype=torch.float64))
    assert torch.equal(out["head"]["w"], _grads(0)["head"]["w"])


def test_masked_passes_none_gradient_through():
    tx = fadam.masked(fadam.scale_by_adam(), MASKS["prefix"])
    params = _params()
    state = tx.init(params)
    g = _grads(0)
    g["encoder"]["b"] = None
    out, new_state = tx.update(g, state, params)
    assert out["encoder"]["b"] is None
    assert new_state.inner_state.mu["encoder"]["b"] is state.inner_state.mu["encoder"]["b"]


def test_masked_rejects_bad_masks():
    params = _params()
    with pytest.raises(TypeError, match=r"\['head'\]\['w'\] is 1; expected a bool"):
        fadam.masked(fadam.identity(), {"encoder": True, "head": {"w": 1}}).init(params)
    with pytest.raises(ValueError, match="mask is not a prefix"):
        fadam.masked(fadam.identity(), {"encoder": True, "decoder": False}).init(params)


# -------------------------------------------------------------------------------------------------------- partition


LABELS = {
    "tree": {"encoder": {"w": "adam", "b": "frozen"}, "head": {"w": "sgd"}},
    "prefix": {"encoder": "adam", "head": "sgd"},
    "callable": lambda params: {
        "encoder": {"w": "adam", "b": "frozen"},
        "head": fadam.tree_map(lambda p: "sgd", params["head"]),
    },
}


def _groups(label_name: str) -> dict[str, str]:
    if label_name == "prefix":
        return {"['encoder']['w']": "adam", "['encoder']['b']": "adam", "['head']['w']": "sgd"}
    return {"['encoder']['w']": "adam", "['encoder']['b']": "frozen", "['head']['w']": "sgd"}


@pytest.mark.parametrize("label_name", list(LABELS))
def test_partition_equals_separate_transforms_per_group(label_name):
    transforms = {
        "adam": fadam.adam(1e-2, weight_decay=0.1),
        "sgd": fadam.sgd(0.1, momentum=0.9),
        "frozen": fadam.set_to_zero(),
    }
    tx = fadam.partition(transforms, LABELS[label_name])
    params = _params()
    state = tx.init(params)
    groups = _groups(label_name)
    assert set(state.inner_states) == set(transforms)
    adam_state = state.inner_states["adam"].inner_state[1]  # chain(add_decayed_weights, scale_by_adam, lr)
    assert [p for p, _ in tensor_leaves(adam_state.mu)] == sorted(p for p, g in groups.items() if g == "adam")

    separate = {}
    for label, sub_tx in transforms.items():
        sub = {path: t for path, t in tensor_leaves(params) if groups[path] == label}
        separate[label] = (sub, sub_tx.init(sub))
    for seed in range(4):
        g = _grads(seed)
        out, state = tx.update(g, state, params)
        grads_by_path = dict(tensor_leaves(g))
        for label, (sub, sub_state) in separate.items():
            sub_out, sub_state = transforms[label].update({path: grads_by_path[path] for path in sub}, sub_state, sub)
            separate[label] = (sub, sub_state)
            for path, u in tensor_leaves(out):
                if groups[path] == label:
                    assert torch.equal(u, sub_out[path]), (label, path)


def test_partition_missing_label_names_the_leaf():
    tx = fadam.partition({"adam": fadam.adam()}, {"encoder": "adam", "head": "sgd"})
    with pytest.raises(ValueError, match=r"label 'sgd' of \['head'\]\['w'\] has no transform"):
        tx.init(_params())


def test_partition_labels_must_be_a_prefix():
    tx = fadam.partition({"adam": fadam.adam()}, {"encoder": "adam"})
    with pytest.raises(ValueError, match="param_labels is not a prefix"):
        tx.init(_params())
