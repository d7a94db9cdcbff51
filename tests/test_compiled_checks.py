"""The compiled leaf checks (``fadam._compiled_checks``) answer what the Python checks they stand for answer, on every
kind of leaf a step meets; and the extension is built once, in the background, or not at all without a compiler."""

from __future__ import annotations

import array
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
from fadam._program import Storage
from fadam._tree import _dense_alike
from fadam.quantization import QuantizedArray, quantize_blockwise

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
    """What ``distinct_storages`` must answer: ``True`` where every leaf is None or a plain strided tensor (a quantized
    one's four tensors each) and the pointers ``overlap_in_leaves`` reads are distinct (zero aside)."""
    trees = [[t for leaf in tree for t in (leaf if type(leaf) is QuantizedArray else (leaf,))] for tree in trees]
    leaves = [leaf for tree in trees for leaf in tree]
    if not all(leaf is None or (type(leaf) in PLAIN_TYPES and leaf.layout is torch.strided) for leaf in leaves):
        return None
    pointers = [p for p in storage_pointers(trees) if p]
    return True if len(set(pointers)) == len(pointers) else None


@needs_build
def test_distinct_storages_answers_as_the_python_pointers(checks):
    buffer = torch.zeros(10)
    tied = torch.ones(3)
    quantized = quantize_blockwise(torch.randn(300))
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
        "quantized slots": [[buffer], [tied], [quantized, quantize_blockwise(torch.ones(300))]],
        "one quantized slot twice": [[buffer], [], [quantized, quantized]],
        "a quantized slot's scales in a param": [[buffer], [], [quantized._replace(absmax=buffer[:2])]],
        "a quantized slot's map id in another's": [[], [], [quantized, quantized._replace(codes=tied.byte())]],
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
    assert loader.build_at_exit() is None


@needs_build
def test_a_missing_build_is_made_as_the_process_exits_and_loaded_by_the_next(monkeypatch, tmp_path):
    target = tmp_path / "checks" / f"fresh{_compiled_checks._library_path().suffix}"
    monkeypatch.setattr(_compiled_checks, "_library_path", lambda: target)
    registered = []
    monkeypatch.setattr(_compiled_checks.atexit, "register", registered.append)
    loader = _compiled_checks._Loader()
    assert loader.get() is None and not loader.given_up  # checked in Python; nothing is compiled meanwhile
    assert registered == [loader.build_at_exit] and not target.parent.exists()
    builder = loader.build_at_exit()  # what the exit runs
    assert builder is not None and builder.args[0] == sys.executable
    assert builder.wait(timeout=300) == 0 and target.exists()
    assert not [p for p in target.parent.iterdir() if p.name.startswith(".build-")]  # its scratch folder is gone
    assert loader.build_at_exit() is None  # built: nothing to do
    module = _compiled_checks._Loader().get()  # the next process's
    assert module is not None and module.placed([torch.ones(2)], torch.float32, torch.device("cpu"), True)


@needs_build
def test_a_failed_build_is_not_tried_again(monkeypatch, tmp_path):
    target = tmp_path / "checks" / "broken.so"
    monkeypatch.setattr(_compiled_checks, "_library_path", lambda: target)
    monkeypatch.setattr(_compiled_checks, "_SOURCE", "this is no C++")
    monkeypatch.setattr(_compiled_checks.atexit, "register", lambda hook: None)
    loader = _compiled_checks._Loader()
    assert loader.get() is None
    assert loader.build_at_exit().wait(timeout=300) != 0
    assert b"error" in (tmp_path / "checks" / "broken.so.failed").read_bytes()  # the compiler's message
    later = _compiled_checks._Loader()
    assert later.get() is None and later.given_up
    assert later.build_at_exit() is None


def _quantized_kinds() -> dict[str, object]:
    """Quantized slots of a 1000-element param, as a step finds them: whole, or with one part of another kind."""
    good = quantize_blockwise(torch.randn(1000), bits=8, block_size=256)
    codes, absmax, map_id, _ = good
    return {
        "quantized": good,
        "strided codes": good._replace(codes=torch.stack([codes, codes], -1)[:, 0]),
        "short codes": good._replace(codes=codes[:-1]),
        "float codes": good._replace(codes=codes.float()),
        "2-d absmax": good._replace(absmax=absmax.reshape(1, -1)),
        "float64 absmax": good._replace(absmax=absmax.double()),
        "absmax that requires grad": good._replace(absmax=absmax.clone().requires_grad_()),
        "int64 map id": good._replace(map_id=map_id.long()),
        "1-d map id": good._replace(map_id=map_id.reshape(1)),
        "meta codes": good._replace(codes=codes.to("meta")),
        "shape of another param": good._replace(like=torch.empty(999, 0, dtype=torch.uint8)),
        "subclass absmax": good._replace(absmax=absmax.as_subclass(_Subclass)),
    }


@needs_build
@pytest.mark.parametrize("grad_enabled", [True, False])
def test_ready_answers_the_same_with_the_extension(checks, monkeypatch, grad_enabled):
    """``ready`` asks the extension's ``leaf_ready`` first and decides in Python where it does not accept a leaf: its
    answer is the same with the extension and without, and the common leaves are accepted in C++."""
    from fadam import _execute

    storage = Storage(bits=8, block=256)
    p, u = torch.randn(1000), torch.randn(1000)
    cases = {f"param {name}": [leaf, u] for name, leaf in _leaves().items()}
    cases |= {f"update {name}": [p, leaf] for name, leaf in _leaves().items()}
    cases |= {f"slot {name}": [p, u, leaf] for name, leaf in {**_leaves(), **_quantized_kinds()}.items()}
    cases |= {"two slots": [p, u, torch.zeros(1000), quantize_blockwise(u)], "no slots": [p, u]}
    for name, (param, update, *slots) in cases.items():
        if not isinstance(param, torch.Tensor):
            continue
        answers = []
        for found in (checks, None):
            monkeypatch.setattr(_execute, "compiled_checks", lambda found=found: found)
            for quantized in (storage, None):
                answers.append(_execute.ready(param, update, slots, grad_enabled, quantized))
        assert answers[:2] == answers[2:], name
    cpu = torch.device("cpu")
    for name in ("no slots", "two slots", "slot quantized", "slot float32"):
        assert checks.leaf_ready(cases[name], torch.float32, cpu, grad_enabled, 1000, 4), name
    assert not checks.leaf_ready(cases["slot quantized"], torch.float32, cpu, grad_enabled, -1, -1)


@needs_build
@pytest.mark.parametrize("grad_enabled", [True, False])
def test_rows_ready_accepts_only_leaves_that_ready_accepts_and_codes_their_layout(checks, grad_enabled):
    """``rows_ready`` answers for many leaves at once what ``ready``'s compiled check answers for each, with a code
    that tells the param's dtype and which slots are quantized; 0 only sends a leaf to ``ready``, so a leaf it accepts
    must be one ``ready`` accepts, and the common leaves must be accepted."""
    from fadam import _execute

    p, u = torch.randn(1000), torch.randn(1000)
    cases = {f"param {name}": [leaf, u] for name, leaf in _leaves().items()}
    cases |= {f"update {name}": [p, leaf] for name, leaf in _leaves().items()}
    cases |= {f"slot {name}": [p, u, leaf] for name, leaf in {**_leaves(), **_quantized_kinds()}.items()}
    cases |= {"two slots": [p, u, torch.zeros(1000), quantize_blockwise(u)], "no slots": [p, u]}
    cases |= {"float64 param": [p.double(), u.double(), torch.zeros(1000, dtype=torch.float64)]}
    cases |= {"0-d float64 param": [torch.tensor(1.0, dtype=torch.float64)] * 2, "missing update": [p, None]}
    for storage in (Storage(bits=8, block=256), None):
        bits, block = (0, 0) if storage is None else (storage.bits, storage.block)
        rows = list(cases.values())
        codes = checks.rows_ready(
            [r[0] for r in rows], [r[1] for r in rows], [r[2:] for r in rows], grad_enabled, bits, block
        )
        for (name, (param, update, *slots)), code in zip(cases.items(), codes):
            if code:
                assert _execute.ready(param, update, slots, grad_enabled, storage), name
                dtypes = {torch.float32: 1, torch.float64: 2, torch.bfloat16: 3}
                mask = sum(1 << k for k, slot in enumerate(slots) if type(slot) is QuantizedArray)
                assert code == dtypes[param.dtype] + 4 * mask, name
        common = ["no slots", "slot float32", "float64 param"] + (["two slots", "slot quantized"] if storage else [])
        assert all(codes[list(cases).index(name)] for name in common), storage
    assert checks.rows_ready([p], [u], [[quantize_blockwise(u)]], grad_enabled, 0, 0) == [0]
    with pytest.raises(ValueError, match="one update and one row"):
        checks.rows_ready([p], [], [[]], grad_enabled, 0, 0)


@needs_build
def test_same_places_compares_a_quantized_slot_by_its_shape_and_its_codes_device(checks):
    for name, slot in _quantized_kinds().items():
        for reference in (torch.ones(1000), torch.ones(10, 100), torch.ones(999), torch.ones(1000, device="meta")):
            expected = True if _same_place(slot, reference) else None
            assert checks.same_places([[slot]], [reference]) is expected, (name, reference.shape)


@needs_build
def test_data_pointers_are_each_tensors_data_pointer_in_turn(checks):
    base = torch.arange(10.0)
    rows = [[base, base[3:], torch.ones(0)], [torch.nn.Parameter(torch.ones(2)), base[::2], torch.ones(3).t()]]
    found = array.array("Q")
    found.frombytes(checks.data_pointers(rows))
    assert list(found) == [t.data_ptr() for row in rows for t in row]
    with pytest.raises(TypeError, match="plain tensors"):
        checks.data_pointers([[torch.ones(2).as_subclass(_Subclass)]])
