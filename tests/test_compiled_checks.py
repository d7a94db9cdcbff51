"""The compiled leaf checks (``fadam._compiled_checks``) answer what the Python checks they stand for answer, on every
kind of leaf a step meets; and the extension is built once, in the background, or not at all without a compiler."""

from __future__ import annotations

import itertools
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from fadam import _compiled_checks
from fadam._cpu_kernel import _compiler
from fadam._dispatch import PLAIN_TYPES, storage_pointers
from fadam._execute import _same_place, placed_in_python
from fadam._tree import _dense_alike

_HEADERS = Path(sysconfig.get_paths()["include"], "Python.h").exists()
needs_build = pytest.mark.skipif(
    _compiler() is None or not _HEADERS, reason="the extension needs a C++ compiler and Python's headers"
)


@pytest.fixture(scope="module")
def checks():
    path = _compiled_checks._library_path()
    assert path.exists() or _compiled_checks.build(path)
    module = _compiled_checks._load(path)
    assert module is not None
    return module


class _Subclass(torch.Tensor):
    pass


def _leaves() -> dict[str, object]:
    """One of each kind of leaf a step may be given."""
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    needs_grad = torch.ones(3, requires_grad=True)
    return {
        "float32": torch.ones(4, 6),
        "float64": torch.ones(4, 6, dtype=torch.float64),
        "float16": torch.ones(4, 6, dtype=torch.float16),
        "bfloat16": torch.ones(4, 6, dtype=torch.bfloat16),
        "complex64": torch.ones(4, 6, dtype=torch.complex64),
        "float8": torch.ones(4, 6).to(torch.float8_e4m3fn),
        "int64": torch.ones(4, 6, dtype=torch.int64),
        "bool": torch.ones(4, 6, dtype=torch.bool),
        "0-d": torch.tensor(2.0),
        "empty": torch.ones(0, 6),
        "transposed": base.t(),
        "every other": base.reshape(-1)[::2],
        "offset view": base.reshape(-1)[1:],
        "expanded": torch.ones(1, 6).expand(4, 6),
        "channels last": torch.ones(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "requires grad": needs_grad,
        "non-leaf of a graph": needs_grad * 2,
        "parameter": torch.nn.Parameter(torch.ones(4, 6)),
        "frozen parameter": torch.nn.Parameter(torch.ones(4, 6), requires_grad=False),
        "subclass": torch.ones(4, 6).as_subclass(_Subclass),
        "sparse": torch.ones(4, 6).to_sparse(),
        "meta": torch.ones(4, 6, device="meta"),
        "conjugate view": torch.ones(4, 6, dtype=torch.complex64).conj(),
        "negative view": torch._neg_view(torch.ones(4, 6)),
        "None": None,
        "not a tensor": 1.0,
    }


@needs_build
@pytest.mark.parametrize("grad_enabled", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.complex64])
@pytest.mark.parametrize("device", [torch.device("cpu"), torch.device("meta")])
def test_placed_answers_as_the_python_check(checks, grad_enabled, dtype, device):
    leaves = _leaves()
    for name, leaf in leaves.items():
        expected = placed_in_python([leaf], device, dtype, grad_enabled)
        assert checks.placed([leaf], dtype, device, grad_enabled) is expected, name
    for (a, x), (b, y) in itertools.product(leaves.items(), repeat=2):  # and as a list: every item counts
        expected = placed_in_python([x, y], device, dtype, grad_enabled)
        assert checks.placed((x, y), dtype, device, grad_enabled) is expected, (a, b)


@needs_build
def test_placed_accepts_what_the_kernels_take(checks):
    cpu = torch.device("cpu")
    assert checks.placed(
        [torch.ones(3), torch.nn.Parameter(torch.ones(2), requires_grad=False)], torch.float32, cpu, True
    )
    assert checks.placed([], torch.float32, cpu, True)
    assert not checks.placed([torch.ones(3), torch.ones(4, 4).t()], torch.float32, cpu, True)
    assert not checks.placed([torch.ones(3, requires_grad=True)], torch.float32, cpu, True)
    assert checks.placed([torch.ones(3, requires_grad=True)], torch.float32, cpu, False)


def _distinct_in_python(trees: list[list[object]]) -> bool | None:
    """What ``distinct_storages`` must answer: ``True`` where every leaf is None or a plain strided tensor and the
    pointers ``overlap_in_leaves`` reads are distinct (zero aside)."""
    leaves = [leaf for tree in trees for leaf in tree]
    if not all(leaf is None or (type(leaf) in PLAIN_TYPES and leaf.layout is torch.strided) for leaf in leaves):
        return None
    pointers = [p for p in storage_pointers(trees) if p]
    return True if len(set(pointers)) == len(pointers) else None


@needs_build
def test_distinct_storages_answers_as_the_python_pointers(checks):
    buffer = torch.zeros(10)
    tied = torch.ones(3)
    kinds = {
        "separate": [[torch.ones(2), torch.ones(2)], [torch.ones(2)], []],
        "tied": [[tied, tied], [], []],
        "views of one buffer": [[buffer[:5], buffer[5:]], [], []],
        "a grad that is a param": [[tied], [tied], []],
        "state in a param": [[buffer], [None], [buffer[2:4]]],
        "empty ones": [[torch.ones(0), torch.ones(0)], [], [torch.ones(0)]],
        "meta ones": [[torch.ones(2, device="meta"), torch.ones(2, device="meta")], [], []],
        "None leaves": [[None, torch.ones(2)], [None], [None]],
        "sparse": [[torch.ones(2)], [torch.ones(2).to_sparse()], []],
        "subclass": [[torch.ones(2).as_subclass(_Subclass)], [], []],
        "parameter": [[torch.nn.Parameter(torch.ones(2))], [torch.ones(2)], []],
        "no leaves": [[], [], []],
    }
    for name, trees in kinds.items():
        assert checks.distinct_storages(trees) is _distinct_in_python(trees), name


@needs_build
def test_first_unlike_skips_exactly_the_pairs_the_python_check_accepts(checks):
    leaves = _leaves()
    for (a, leaf), (b, ref) in itertools.product(leaves.items(), repeat=2):
        plain = type(leaf) in PLAIN_TYPES and type(ref) in PLAIN_TYPES
        skipped = leaf is None or (plain and _dense_alike(leaf, ref))
        assert checks.first_unlike([leaf], [ref], 0) == (1 if skipped else 0), (a, b)
    ones = [torch.ones(2), torch.ones(3), torch.ones(2)]
    assert checks.first_unlike(ones, ones, 0) == 3
    assert checks.first_unlike([ones[0], ones[1], ones[2]], [ones[0], ones[0], ones[0]], 0) == 1
    assert checks.first_unlike([ones[0], ones[1], ones[2]], [ones[0], ones[0], ones[0]], 2) == 3


def test_without_a_compiler_the_checks_stay_in_python(monkeypatch):
    monkeypatch.setattr(_compiled_checks, "_library_path", lambda: None)
    loader = _compiled_checks._Loader()
    assert loader.get() is None and loader.given_up
    assert loader.builder is None


@needs_build
def test_a_missing_build_is_made_in_a_process_of_its_own_and_then_loaded(monkeypatch, tmp_path):
    target = tmp_path / "checks" / f"fresh{_compiled_checks._library_path().suffix}"
    monkeypatch.setattr(_compiled_checks, "_library_path", lambda: target)
    loader = _compiled_checks._Loader()
    assert loader.get() is None  # the build started; the caller checks in Python meanwhile
    builder = loader.builder
    assert builder is not None and builder.args[0] == sys.executable
    assert builder.wait(timeout=300) == 0 and target.exists()
    assert not [p for p in target.parent.iterdir() if p.name.startswith(".build-")]  # its scratch folder is gone
    module = loader.get()
    assert loader.builder is builder  # one build
    assert module is not None and module.placed([torch.ones(2)], torch.float32, torch.device("cpu"), True)


@needs_build
def test_a_failed_build_is_not_retried(monkeypatch, tmp_path):
    monkeypatch.setattr(_compiled_checks, "_library_path", lambda: tmp_path / "checks" / "broken.so")
    monkeypatch.setattr(_compiled_checks, "_SOURCE", "this is no C++")
    loader = _compiled_checks._Loader()
    assert loader.get() is None
    assert loader.builder.wait(timeout=300) != 0
    assert loader.get() is None and loader.given_up


@needs_build
def test_same_places_answers_as_the_python_comparison(checks):
    leaves = _leaves()
    for (a, slot), (b, reference) in itertools.product(leaves.items(), repeat=2):
        plain = type(slot) in PLAIN_TYPES and type(reference) in PLAIN_TYPES
        expected = True if plain and _same_place(slot, reference) else None
        assert checks.same_places([[slot]], [reference]) is expected, (a, b)
    ones = [torch.ones(2), torch.ones(3)]
    assert checks.same_places([ones, [torch.zeros(2), torch.zeros(3)]], ones) is True
    assert checks.same_places([ones, [torch.zeros(2), torch.zeros(4)]], ones) is None
    assert checks.same_places([ones[:1]], ones) is None  # lists of another length: compared in Python
    assert checks.same_places([], ones) is True
