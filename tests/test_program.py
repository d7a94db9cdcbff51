"""The generated CPU kernel (``fadam._cpu_kernel``) against the eager path (``tx.update`` then ``apply_updates``).

The contract: bit for bit equal results, params and every state leaf, float32, float64 and bfloat16 (on leaves
where ATen's own loops have no scalar tail, see ``test_bfloat16_steps_equal_the_eager_path_bit_for_bit``),
quantized state included, donated or not. The
programs are chains of declared transforms (or ``fadam.lion``), not the aliases that ``fadam.step`` hands to torch's
own fused kernels, so that the step runs the generated kernel.
"""

import math

import numpy
import optree
import pytest
import torch

import fadam
from fadam import _cpu_kernel
from fadam._execute import explain
from fadam._program import EagerOps, Elementwise, elementwise
from tests import kernel_functions

KERNEL = "generated CPU kernel"


@pytest.fixture(autouse=True, scope="module")
def _kernel_cache(tmp_path_factory: pytest.TempPathFactory):
    """Kernels compile into one temporary folder, not the home directory; two threads, so that the large leaf's
    chunks are spread over OpenMP threads as on a real machine (conftest sets one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FADAM_CACHE_DIR", str(tmp_path_factory.mktemp("fadam-cache")))
        _cpu_kernel._load_source.cache_clear()
        yield
    _cpu_kernel._load_source.cache_clear()
    torch.set_num_threads(threads)


def _params(dtype=torch.float32):
    """A leaf above the kernel's threading threshold (odd: chunk and vector tails), a small matrix, a complex leaf."""
    gen = torch.Generator().manual_seed(0)
    complex_dtype = torch.complex64 if dtype == torch.float32 else torch.complex128
    return {
        "big": torch.randn(70_001, generator=gen, dtype=dtype),
        "matrix": torch.randn(3, 5, generator=gen, dtype=dtype),
        "complex": torch.randn(17, generator=gen, dtype=complex_dtype),
    }


def _grads(params, seed):
    """Magnitudes from 1e-6 to 1e3, with zeros and negative zeros at places that move with ``seed``."""
    gen = torch.Generator().manual_seed(seed)

    def leaf(p):
        real = torch.view_as_real(p) if p.is_complex() else p
        g = torch.randn(real.shape, generator=gen, dtype=real.dtype)
        g = g * 10.0 ** torch.randint(-6, 4, real.shape, generator=gen).to(real.dtype)
        g.view(-1)[seed % 7 :: 7] = 0.0
        g.view(-1)[seed % 5 :: 11] = -0.0
        return torch.view_as_complex(g) if p.is_complex() else g

    return optree.tree_map(leaf, params)


def _eager_step(tx, params, grads, state):
    with fadam.backend("eager"):
        updates, state = tx.update(grads, state, params)
    return fadam.apply_updates(params, updates), state


def _clone(tree):
    return optree.tree_map(torch.clone, tree)


_INTEGERS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16}


def _bits(t, equal_nan):
    """``t``'s bit patterns (complex as pairs of reals); with ``equal_nan`` every NaN is one NaN (its sign and
    payload are no value)."""
    t = torch.view_as_real(t.detach()) if t.is_complex() else t.detach()
    if t.dtype not in _INTEGERS:
        return t  # a step count
    if equal_nan:
        t = torch.where(t.isnan(), float("nan"), t)
    return t.view(_INTEGERS[t.dtype])


def _mismatches(kernel, eager, equal_nan=False):
    """The paths of the leaves whose dtypes or bits differ (so a zero's sign counts)."""
    assert optree.tree_structure(kernel) == optree.tree_structure(eager)
    return [
        path
        for path, a, b in zip(optree.tree_paths(kernel), optree.tree_leaves(kernel), optree.tree_leaves(eager))
        if a.dtype != b.dtype or not torch.equal(_bits(a, equal_nan), _bits(b, equal_nan))
    ]


def _double():
    """An opaque user transform (no declaration): it splits a program into segments."""
    return fadam.GradientTransformation(
        lambda params: fadam.EmptyState(), lambda u, s, p=None: (optree.tree_map(lambda g: 2 * g, u), s)
    )


_schedule = fadam.schedules.cosine_decay_schedule(1e-2, decay_steps=4)
_lr = fadam.scale_by_learning_rate

PROGRAMS = {
    "adam": lambda: fadam.chain(fadam.scale_by_adam(), _lr(1e-2)),
    "adam-amsgrad": lambda: fadam.chain(fadam.scale_by_adam(amsgrad=True), _lr(1e-2)),
    "adam-nesterov": lambda: fadam.chain(fadam.scale_by_adam(nesterov=True), _lr(1e-2)),
    "adam-eps_root": lambda: fadam.chain(fadam.scale_by_adam(eps_root=1e-8), _lr(1e-2)),
    "adam-tensor-hyperparams": lambda: fadam.chain(
        fadam.scale_by_adam(torch.tensor(0.8), torch.tensor(0.99), torch.tensor(1e-6)), _lr(torch.tensor(1e-2))
    ),
    "adamw": lambda: fadam.chain(fadam.scale_by_adam(), fadam.add_decayed_weights(0.1), _lr(1e-2)),
    "lion": lambda: fadam.chain(fadam.scale_by_lion(), _lr(1e-3)),
    "lion-alias": lambda: fadam.lion(lr=1e-3, weight_decay=0.1),
    "momentum": lambda: fadam.chain(fadam.trace(0.9), _lr(1e-2)),
    "momentum-nesterov": lambda: fadam.chain(fadam.trace(0.9, nesterov=True), _lr(1e-2)),
    "momentum-dampening": lambda: fadam.chain(fadam.trace(0.9, dampening=0.3), _lr(1e-2)),
    "decay-masked": lambda: fadam.chain(
        fadam.scale_by_adam(),
        fadam.add_decayed_weights(0.1, mask={"big": True, "matrix": False, "complex": True}),
        _lr(1e-2),
    ),
    "decay-schedule": lambda: fadam.chain(fadam.add_decayed_weights(lambda count: 0.1 / (count + 1)), _lr(1e-2)),
    "decoupled-decay": lambda: fadam.chain(
        fadam.scale_by_adam(), _lr(1e-2), fadam.add_decoupled_weight_decay(1e-2, 0.1)
    ),
    "decoupled-decay-schedule": lambda: fadam.chain(
        fadam.scale_by_adam(), _lr(_schedule), fadam.add_decoupled_weight_decay(_schedule, 0.1)
    ),
    "scale": lambda: fadam.scale(-1e-3),
    "lr-schedule": lambda: fadam.chain(fadam.trace(0.5), _lr(_schedule)),
    "scale_by_schedule": lambda: fadam.scale_by_schedule(lambda count: -1e-3 * (count + 1)),
    "clip": lambda: fadam.chain(fadam.clip(0.5), _lr(1e-2)),
    "clip_by_global_norm": lambda: fadam.chain(fadam.clip_by_global_norm(1.0), fadam.trace(0.9), _lr(1e-1)),
    "adam-then-global-norm": lambda: fadam.chain(fadam.scale_by_adam(), fadam.clip_by_global_norm(10.0), _lr(1e-2)),
    "clip-adamw": lambda: fadam.chain(
        fadam.clip(1.0), fadam.scale_by_adam(), fadam.add_decayed_weights(0.01), _lr(1e-2)
    ),
    "optax-clip-adamw-schedule": lambda: fadam.chain(
        fadam.clip_by_global_norm(1.0), fadam.scale_by_adam(), fadam.add_decayed_weights(1e-4), _lr(_schedule)
    ),
    "opaque-in-the-middle": lambda: fadam.chain(fadam.scale_by_adam(), _double(), _lr(1e-2)),
    "lamb": lambda: fadam.lamb(1e-2, weight_decay=0.1),  # a per-leaf trust ratio between two segments
    "partition": lambda: fadam.partition(
        {
            "adam": fadam.chain(fadam.scale_by_adam(), _lr(1e-2)),
            "lion": fadam.lion(1e-3),
            "frozen": fadam.set_to_zero(),
        },
        {"big": "adam", "matrix": "lion", "complex": "adam"},
    ),
    "nested-masks": lambda: fadam.masked(
        fadam.chain(
            fadam.masked(fadam.scale(3.0), {"big": False, "matrix": True, "complex": True}), fadam.scale_by_lion()
        ),
        {"big": True, "matrix": True, "complex": True},
    ),
    "inject_hyperparams": lambda: fadam.inject_hyperparams(fadam.lion)(lr=1e-3, weight_decay=0.1),
    "block-rms": lambda: fadam.chain(
        fadam.clip_by_block_rms(0.5), fadam.scale_by_adam(), fadam.scale_by_param_block_rms(), _lr(1e-2)
    ),
    "adafactor": lambda: fadam.adafactor(1e-2, min_dim_size_to_factor=2),  # factored statistics of the matrix
}


def _side_by_side(tx, params, steps, donate):
    """Both paths' trajectories from the same start, asserted equal after every step (so every step starts from
    equal inputs)."""
    eager = (params, tx.init(params))
    kernel = _clone(eager)
    for step in range(steps):
        grads = _grads(eager[0], seed=step)
        eager = _eager_step(tx, eager[0], grads, eager[1])
        kernel = fadam.step(tx, kernel[0], grads, kernel[1], donate=donate)
        assert _mismatches(kernel, eager) == [], f"step {step}"


@pytest.mark.parametrize("donate", [False, True], ids=["kept", "donated"])
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_five_steps_equal_the_eager_path_bit_for_bit(name, donate, kernel_runs):
    tx = PROGRAMS[name]()
    kernel_leaves = sum(line.count("['") for line in explain(tx, _params()).splitlines() if KERNEL in line)
    assert kernel_leaves >= 3
    _side_by_side(tx, _params(), steps=5, donate=donate)
    assert sum(kernel_runs) == 5 * kernel_leaves  # the step ran the kernel where explain says it does


@pytest.mark.parametrize("donate", [False, True], ids=["kept", "donated"])
@pytest.mark.parametrize("name", ["adamw", "adam-amsgrad", "lion-alias", "momentum-nesterov", "clip-adamw"])
def test_float64_steps_equal_the_eager_path_bit_for_bit(name, donate, kernel_runs):
    _side_by_side(PROGRAMS[name](), _params(torch.float64), steps=3, donate=donate)
    assert kernel_runs == [3] * 3


def test_explain_shows_segments_split_by_a_reduction_and_by_an_opaque_transform():
    params = _params()
    after_adam = explain(PROGRAMS["adam-then-global-norm"](), params).splitlines()
    assert [line.split(":")[0] for line in after_adam] == [
        "scale_by_adam",
        "clip_by_global_norm -> scale_by_learning_rate",
    ]
    assert all(KERNEL in line for line in after_adam)
    opaque = explain(PROGRAMS["opaque-in-the-middle"](), params).splitlines()
    assert len(opaque) == 3
    assert KERNEL in opaque[0] and "eager (an opaque transform)" in opaque[1] and KERNEL in opaque[2]


def _mixed():
    """Leaves that take the kernel ("big") and leaves that cannot, each for its own reason."""
    gen = torch.Generator().manual_seed(1)
    params = {
        "big": torch.randn(70_001, generator=gen),
        "transposed": torch.randn(4, 3, generator=gen).t(),
        "float16": torch.randn(5, generator=gen).to(torch.float16),
        "no_grad": torch.randn(6, generator=gen),
        "tracked": torch.randn(3, generator=gen).requires_grad_(),
    }
    grads = {k: torch.randn(p.shape, generator=gen).to(p.dtype) for k, p in params.items()}
    grads["transposed"] = grads["transposed"].t().contiguous().t()  # as strided as its param
    return params, {**grads, "no_grad": None}


def test_explain_gives_each_eager_leaf_its_reason():
    params, grads = _mixed()
    program = "scale_by_adam -> add_decayed_weights -> scale_by_learning_rate"
    assert set(explain(PROGRAMS["adamw"](), params, grads).splitlines()) == {
        f"{program}: {KERNEL}: ['big']",
        f"{program}: eager: not contiguous: ['transposed']",
        f"{program}: eager: torch.float16 (the kernel takes float32, float64 and bfloat16): ['float16']",
        f"{program}: eager: no gradient: ['no_grad']",
        f"{program}: eager: autograd or torch.func records it: ['tracked']",
    }


@pytest.mark.parametrize("donate", [False, True], ids=["kept", "donated"])
def test_a_mixed_tree_equals_the_eager_path_bit_for_bit(donate, kernel_runs):
    tx = PROGRAMS["adamw"]()
    params, grads = _mixed()
    eager = (params, tx.init(params))
    kernel = _clone(eager)
    for step in range(3):
        eager = _eager_step(tx, eager[0], grads, eager[1])
        kernel = fadam.step(tx, kernel[0], grads, kernel[1], donate=donate)
        assert _mismatches(kernel, eager) == [], f"step {step}"
    assert kernel_runs == [1] * 3  # "big" only


@pytest.mark.parametrize("donate", [False, True], ids=["kept", "donated"])
def test_leaves_without_elements_between_others_take_the_kernel_and_shift_no_chunk(donate, kernel_runs):
    # the kernel finds each chunk's leaf by bisecting the leaves' first chunks, which an empty leaf repeats
    shapes = [(0,), (100,), (0,), (0, 3), (2 * _cpu_kernel._CHUNK + 1,), (0,), (5,), (_cpu_kernel._CHUNK,), (0,)]
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, generator=gen, dtype=torch.float64) for shape in shapes]
    _side_by_side(fadam.lion(1e-2, weight_decay=0.1), params, steps=2, donate=donate)
    assert kernel_runs == [len(shapes)] * 2


def test_a_donated_step_writes_the_given_buffers():
    tx = PROGRAMS["adamw"]()
    params = _params()
    state = tx.init(params)
    new_params, new_state = fadam.step(tx, params, _grads(params, seed=0), state, donate=True)
    assert all(new is old for new, old in zip(optree.tree_leaves(new_params), optree.tree_leaves(params)))
    for moment in ("mu", "nu"):
        pairs = zip(optree.tree_leaves(getattr(new_state[0], moment)), optree.tree_leaves(getattr(state[0], moment)))
        assert all(new is old for new, old in pairs)


def test_a_kept_step_modifies_nothing_it_is_given():
    tx = PROGRAMS["adamw"]()
    params = _params()
    grads = _grads(params, seed=0)
    state = fadam.step(tx, params, grads, tx.init(params))[1]  # moments that are not zeros
    before = _clone((params, grads, state))
    new_params, _ = fadam.step(tx, params, grads, state)
    assert _mismatches((params, grads, state), before) == []
    assert not any(new is old for new, old in zip(optree.tree_leaves(new_params), optree.tree_leaves(params)))


def test_kernels_are_kept_in_fadam_cache_dir_and_loaded_from_it(tmp_path, monkeypatch):
    monkeypatch.setenv("FADAM_CACHE_DIR", str(tmp_path))
    tx = fadam.chain(fadam.scale_by_lion(b1=0.8), _lr(1e-3))
    params = _params()
    _cpu_kernel._load_source.cache_clear()
    params, state = fadam.step(tx, params, _grads(params, seed=0), tx.init(params))
    (library,) = (tmp_path / "kernels").glob("*.so")
    built = library.stat().st_mtime_ns

    def compile_again(*args):
        raise AssertionError("compiled a kernel that is on disk")

    monkeypatch.setattr(_cpu_kernel, "_compile", compile_again)
    _cpu_kernel._load_source.cache_clear()
    grads = _grads(params, seed=1)
    kernel = fadam.step(tx, _clone(params), grads, _clone(state))
    assert _mismatches(kernel, _eager_step(tx, params, grads, state)) == []
    assert library.stat().st_mtime_ns == built


@pytest.fixture
def no_compiler(monkeypatch):
    monkeypatch.setattr(_cpu_kernel, "_compiler", lambda: None)
    _cpu_kernel._load_source.cache_clear()
    _cpu_kernel._warn_once.cache_clear()
    yield
    _cpu_kernel._load_source.cache_clear()  # it holds None for the sources loaded here
    _cpu_kernel._warn_once.cache_clear()


@pytest.mark.usefixtures("no_compiler")
def test_without_a_compiler_a_step_warns_once_and_equals_the_eager_path():
    tx = PROGRAMS["adamw"]()
    eager = (_params(), tx.init(_params()))
    kernel = _clone(eager)
    with pytest.warns(UserWarning, match="no C\\+\\+ compiler") as caught:
        for step in range(2):
            grads = _grads(eager[0], seed=step)
            eager = _eager_step(tx, eager[0], grads, eager[1])
            kernel = fadam.step(tx, kernel[0], grads, kernel[1])
    assert len(caught) == 1
    assert caught[0].filename == __file__  # the line that called fadam, not one inside it
    assert _mismatches(kernel, eager) == []


@pytest.mark.usefixtures("no_compiler")
def test_without_a_compiler_explain_says_the_kernel_leaves_run_eagerly_and_why():
    tx = fadam.chain(fadam.scale_by_lion(), fadam.scale(-1e-4))
    found = fadam.explain(tx, {"w": torch.zeros(4)})
    assert found == "scale_by_lion -> scale: eager: no C++ compiler found (set CXX): ['w']"


EDGES = [float("inf"), float("-inf"), float("nan"), -0.0, 0.0, 1e-40, -1e-300, -1e30]  # and subnormals


def _edge_grads(params):
    """Ordinary gradients with each edge value at places spread over vector lanes and the chunk tails."""
    grads = _grads(params, seed=3)
    for g in optree.tree_leaves(grads):
        flat = (torch.view_as_real(g) if g.is_complex() else g).view(-1)
        for k, value in enumerate(EDGES):
            flat[k :: len(EDGES) + 2] = value
    return grads


@pytest.mark.parametrize("name", ["adam", "adam-amsgrad", "lion", "momentum-nesterov", "momentum-dampening", "clip"])
def test_inf_nan_and_signed_zeros_in_one_step_equal_the_eager_path(name, kernel_runs):
    tx = PROGRAMS[name]()
    params = {key: leaf for key, leaf in _params().items() if key != "complex"}  # complex: the test below
    start = _eager_step(tx, params, _grads(params, seed=0), tx.init(params))  # moments that are not zeros
    grads = _edge_grads(params)
    eager = _eager_step(tx, start[0], grads, start[1])
    params, state = _clone(start)
    kernel = fadam.step(tx, params, grads, state)
    assert kernel_runs == [2]
    assert _mismatches(kernel, eager, equal_nan=True) == []
    assert any(t.isnan().any() for t in optree.tree_leaves(eager))  # the NaN-aware comparison met NaN


@pytest.mark.parametrize("value", [float("inf"), float("nan"), -0.0], ids=["inf", "nan", "negative-zero"])
def test_a_complex_leaf_adds_its_update_as_the_eager_path_does(value):
    tx = fadam.scale(1.0)
    params = {"complex": torch.tensor([complex(-0.0, 2.0)] * 3)}
    grads = {"complex": torch.tensor([complex(value, -1.0)] * 3)}
    eager = _eager_step(tx, params, grads, tx.init(params))
    kernel = fadam.step(tx, _clone(params), grads, tx.init(params))
    assert _mismatches(kernel, eager, equal_nan=True) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_lerp_of_weight_one_signs_its_zeros_alike_wherever_they_lie(dtype, kernel_runs):
    """Adam without momentum (``b1 = 0``) lerps its first moment with a weight of 1: torch.lerp's zeros are -0 in the
    body of ATen's vector loop and +0 in its scalar tail (the last elements of a leaf of 40); the eager path's and the
    kernel's are -0 everywhere."""
    tx = fadam.chain(fadam.scale_by_adam(b1=0.0), _lr(1e-2))
    params = {"p": torch.ones(40, dtype=dtype)}
    grads = {"p": torch.full((40,), -0.0, dtype=dtype)}
    eager = _eager_step(tx, params, grads, tx.init(params))
    kernel = fadam.step(tx, params, grads, tx.init(params))
    assert kernel_runs == [1]
    assert _mismatches(kernel, eager) == []
    assert torch.signbit(eager[1][0].mu["p"]).all()


@pytest.mark.parametrize("weight", [1.0, 0.7, 0.2])
def test_the_eager_lerp_has_torch_lerps_values_and_derivatives(weight):
    """At a tensor weight of 1 over a 0-d leaf too, where it computes ``end + (end - start) * (weight - 1)``: the
    derivative by the weight (a meta-gradient through ``b1``) is still ``end - start``."""
    inputs = [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in (0.3, -1.1, weight)]
    copies = [t.detach().clone().requires_grad_() for t in inputs]
    ours, theirs = EagerOps.lerp(*inputs), torch.lerp(*copies)
    (ours * 3.0).backward()
    (theirs * 3.0).backward()
    assert ours.item() == theirs.item()
    assert [t.grad.item() for t in inputs] == [t.grad.item() for t in copies]


def test_a_number_over_an_element_rounds_as_torch_rounds_it():
    """torch computes ``number / tensor`` as ``tensor.reciprocal() * number`` (two roundings): the traced body too."""
    from fadam._program import Elementwise, elementwise

    def body(o, s, g, p):
        return (0.3 / (g * g + 1.0) + o.rsqrt(g * g + s.eps),)

    tx = elementwise(Elementwise("test_quotient", fadam.EmptyState, (), False, lambda count: {"eps": 1e-3}, body))
    params = {"w": torch.randn(70_001, generator=torch.Generator().manual_seed(3))}
    grads = {"w": torch.randn(70_001, generator=torch.Generator().manual_seed(4))}
    eager = _eager_step(tx, params, grads, tx.init(params))
    kernel = fadam.step(tx, _clone(params), grads, tx.init(params), donate=True)
    assert _mismatches(kernel, eager) == []


QUANTIZED = {
    "adamw8bit": lambda: fadam.adamw8bit(1e-2, weight_decay=0.1),
    "adam8bit-amsgrad-l2": lambda: fadam.adam8bit(1e-2, weight_decay=0.1, amsgrad=True),
    "adamw4bit": lambda: fadam.adamw4bit(1e-2, weight_decay=0.1),
    "adam4bit-block-64": lambda: fadam.adam4bit(1e-2, block_size=64),
    "adamw8bit-block-2048": lambda: fadam.adamw8bit(1e-2, block_size=2048),  # a pass longer than the kernel's
    "lion8bit": lambda: fadam.lion8bit(1e-3, weight_decay=0.1),
    "sgd8bit-nesterov": lambda: fadam.sgd8bit(1e-2, nesterov=True),
    "ademamix8bit": lambda: fadam.ademamix8bit(1e-2),
    "trace-rms-8bit": lambda: fadam.chain(
        fadam.quantize_state(fadam.chain(fadam.trace(0.9), fadam.scale_by_rms()), bits=8), _lr(1e-2)
    ),
    "clip-adam-4bit-masked": lambda: fadam.chain(
        fadam.clip_by_global_norm(1.0),
        fadam.quantize_state(fadam.scale_by_adam(), bits=4, mask={"big": True, "matrix": False, "complex": False}),
        _lr(1e-2),
    ),
}


@pytest.mark.parametrize("donate", [False, True], ids=["kept", "donated"])
@pytest.mark.parametrize("name", list(QUANTIZED))
def test_quantized_state_steps_equal_the_eager_path_bit_for_bit(name, donate, kernel_runs):
    """The 70001-element leaf is quantized (a ragged last block; an odd count at 4 bits, whose last byte holds one
    code), the others (below min_size) keep full precision: two kernel calls a step."""
    tx = QUANTIZED[name]()
    assert any(isinstance(q, fadam.QuantizedArray) for q in _quantized_leaves(tx.init(_params())))
    _side_by_side(tx, _params(), steps=4, donate=donate)
    assert sorted(kernel_runs) == [1] * 4 + [2] * 4  # "big" alone; "matrix" and "complex" together


def _quantized_leaves(state):
    return [q for q in optree.tree_leaves(state, is_leaf=lambda n: isinstance(n, fadam.QuantizedArray))]


@pytest.mark.parametrize("name", ["adamw8bit", "adamw4bit", "lion8bit"])
def test_quantized_state_meets_inf_nan_and_signed_zeros_as_the_eager_path(name, kernel_runs):
    """An infinity sets a block's negated scale, a NaN is stored as 0: the kernel's codes equal the codec's."""
    tx = QUANTIZED[name]()
    params = {key: leaf for key, leaf in _params().items() if key != "complex"}
    start = _eager_step(tx, params, _grads(params, seed=0), tx.init(params))
    grads = _edge_grads(params)
    eager = _eager_step(tx, start[0], grads, start[1])
    params, state = _clone(start)
    kernel = fadam.step(tx, params, grads, state)
    assert sorted(kernel_runs) == [1, 1]
    assert _mismatches(kernel, eager, equal_nan=True) == []
    quantized = [q for q in _quantized_leaves(eager[1]) if isinstance(q, fadam.QuantizedArray)]
    assert any(bool((q.absmax < 0).any()) for q in quantized)  # a block holding an infinity was met


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["f64", "bf16"])
@pytest.mark.parametrize("name", ["adamw8bit", "adamw4bit", "lion8bit"])
def test_quantized_state_of_other_param_dtypes_equals_the_eager_path(name, dtype, kernel_runs):
    """float32 moments decoded for float64 or bfloat16 params: each op in the dtype torch gives it."""
    tx = QUANTIZED[name]()
    gen = torch.Generator().manual_seed(0)
    params = {"big": torch.randn(8192, generator=gen).to(dtype), "small": torch.randn(64, generator=gen).to(dtype)}
    _side_by_side(tx, params, steps=3, donate=True)
    assert sorted(kernel_runs) == [1] * 6


def test_quantized_state_keeps_each_declared_slot_in_its_own_map():
    """A second moment in the non-negative map, a first moment in the signed one even when no entry is negative:
    the map follows the slot (``Slot.nonnegative``), so the kernel and the eager path agree on every step."""
    tx = fadam.quantize_state(fadam.scale_by_adam(), min_size=16)
    params = {"w": torch.zeros(64)}
    for backend in ("eager", "kernel"):
        with fadam.backend(backend):
            _, state = tx.update({"w": torch.ones(64)}, tx.init(params), params)
        assert int(state.inner_state.mu["w"].map_id) == fadam.quantization._maps.MAP_IDS["dynamic8_signed"]
        assert int(state.inner_state.nu["w"].map_id) == fadam.quantization._maps.MAP_IDS["dynamic8_unsigned"]


def test_an_unknown_map_id_is_refused_before_anything_changes():
    tx = fadam.adamw8bit(1e-2)
    params = _params()
    state = tx.init(params)
    state[0].inner_state.mu["big"].map_id.fill_(9)
    before = _clone((params, state))
    with fadam.backend("kernel"), pytest.raises(ValueError, match="unknown map"):
        fadam.step(tx, params, _grads(params, seed=0), state, donate=True)
    assert _mismatches((params, state), before) == []


def _bfloat16_params():
    """Leaves of whole vectors and under ATen's parallel grain (32768 elements): ATen runs every element of their
    eager ops in its vector loop, whose rounding the kernel follows. On a scalar tail ATen rounds some ops otherwise
    (``torch.add(a, b, alpha=k)`` rounds ``k * b`` to bfloat16 first there, where its vector loop fuses it), so a
    leaf of another length may differ from eager by a rounding in a few elements at the ends of ATen's loops."""
    gen = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(8192, generator=gen).to(torch.bfloat16),
        "matrix": torch.randn(4, 64, generator=gen).to(torch.bfloat16),
        "complex": torch.randn(128, generator=gen).to(torch.bfloat16),  # named for the programs' masks
    }


# bfloat16 leaves that meet a tensor as lerp's weight or add's alpha (a scheduled weight decay) run eagerly: EagerOps
# rounds such a tensor to bfloat16, where ATen keeps a number in float
_BFLOAT16_EAGER = {"decay-schedule"}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_bfloat16_steps_equal_the_eager_path_bit_for_bit(name, kernel_runs):
    """bfloat16 params and state: every bfloat16 op computed in float and rounded to nearest even, numbers rounded to
    bfloat16 where ATen rounds them (add, a comparison, clamp, alpha). ``explain`` names the leaves that take it."""
    tx = PROGRAMS[name]()
    report = explain(tx, _bfloat16_params())
    kernel_leaves = sum(line.count("['") for line in report.splitlines() if KERNEL in line)
    assert (kernel_leaves == 0) == (name in _BFLOAT16_EAGER), report
    eager = (_bfloat16_params(), tx.init(_bfloat16_params()))
    kernel = _clone(eager)
    for step in range(3):
        grads = _grads(eager[0], seed=step)
        eager = _eager_step(tx, eager[0], grads, eager[1])
        kernel = fadam.step(tx, kernel[0], grads, kernel[1], donate=step == 1)
        assert _mismatches(kernel, eager, equal_nan=True) == [], f"step {step}"
    assert sum(kernel_runs) == 3 * kernel_leaves


def test_explain_says_whether_torch_fused_kernel_takes_an_alias_step():
    params = {"w": torch.zeros(3), "b": torch.zeros(2)}
    assert explain(fadam.adamw(1e-3), params).endswith(": torch._fused_adamw_: ['b'], ['w']")
    with fadam.backend("kernel"):  # never torch's kernels
        assert explain(fadam.adamw(1e-3), params).endswith(f"{KERNEL}: ['b'], ['w']")
    params["b"] = torch.zeros(4, 2).t()  # torch's kernels walk flat arrays, and so does the generated one
    lines = explain(fadam.adamw(1e-3), params).splitlines()
    assert lines[0].endswith("eager: not contiguous: ['b']") and lines[1].endswith("torch._fused_adamw_: ['w']")


@pytest.mark.parametrize(
    ("make", "dtype"),
    [
        *((lambda: fadam.adamw(1e-3), dtype) for dtype in (torch.float32, torch.float64, torch.bfloat16)),
        (lambda: fadam.lion(1e-3), torch.float32),
        (lambda: fadam.sgd(0.1, 0.9), torch.float32),
    ],
)
def test_a_streamed_kernel_writes_the_plain_kernels_bytes_and_sums_them_as_the_checksum(make, dtype):
    from fadam._execute import segments
    from fadam._program import trace
    from fadam.paging._checksum import leaf_sums

    tx = make()
    program, _ = tx.update.program.expanded(tx.init([torch.zeros(1)]))
    traced = trace(tuple(stage.decl for stage in segments(program)[0].stages), True)
    inputs, slots = len(traced.graph.inputs), len(traced.outputs) - 1
    dtypes = (dtype,) * inputs
    plain, streamed = _cpu_kernel.load(traced, dtypes), _cpu_kernel.load(traced, dtypes, streamed=True)
    sizes = [1, 7, 3 * _cpu_kernel._CHUNK + 5, 70_001]  # partial rows, several chunks, both threads

    def rows():
        gen = torch.Generator().manual_seed(0)
        made = []
        for n in sizes:
            given = [torch.randn(n, generator=gen).to(dtype) for _ in range(inputs)]
            made.append(given + [torch.empty(n, dtype=dtype) for _ in range(slots + 1)])
        return made

    scalars = [0.5 / (k + 1) for k in range(len(traced.graph.scalars))]
    expected, found = rows(), rows()
    plain.run(expected, scalars, [])
    sums = torch.empty((len(sizes), slots, 16), dtype=torch.int64)
    streamed.run(found, scalars, [], sums)
    for i, (want, got) in enumerate(zip(expected, found)):
        for a, b in zip(want[inputs:], got[inputs:]):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for k in range(slots):
            taken = tuple(n & (1 << 64) - 1 for n in sums[i, k].tolist())
            assert taken == leaf_sums(got[inputs + k].view(torch.uint8)), (i, k)


def _square_roots() -> torch.Tensor:
    """Float32 square roots over their whole range (2**-74.5 to 2**64): its ends, every power of two with its
    neighbours, random ones; zeros, infinity and NaN."""
    gen = torch.Generator().manual_seed(0)
    powers = 2.0 ** torch.arange(-74.0, 64.0)
    near = [powers, torch.nextafter(powers, torch.tensor(0.0)), torch.nextafter(powers, torch.tensor(float("inf")))]
    ends = torch.tensor([2.0**-149, 3 * 2.0**-149, 2.0**-126, 3.4028234663852886e38]).sqrt()
    special = torch.tensor([0.0, -0.0, float("inf"), float("nan")])
    spread = 10.0 ** (torch.rand(200_000, generator=gen, dtype=torch.float64) * 38 - 22)
    return torch.cat([*near, ends, special, spread.float()])


def _divisors() -> list[float]:
    """Adam's bias corrections sqrt(1 - b2**t) of float32, the ends of the significand and of the range the kernel
    takes without dividing, and negative ones."""
    corrections = [math.sqrt(1 - b2**t) for b2 in (0.9, 0.99, 0.999, 0.99999) for t in (1, 2, 3, 10, 77, 1000, 4321)]
    ends = [1.0, 2 - 2**-23, 1.5, math.sqrt(2), 2.0**-50, 2.0**50, (2 - 2**-23) * 2.0**-51, 3.0]
    return [float(torch.tensor(d, dtype=torch.float32)) for d in [*corrections, *ends, -0.7, -(2 - 2**-23)]]


def test_a_square_root_over_a_number_rounds_as_the_division_rounds():
    # fadam_divide_root: three FMAs and a product (fadam._cpu_kernel._divided_roots gives the proof);
    # benchmarks/check_division_exhaustive.py checks every float32 square root for a set of divisors
    if not kernel_functions.available():
        pytest.skip("no C++ compiler")
    x = _square_roots()
    for d in _divisors():
        got, _ = kernel_functions.kernel_divide_root(x, d)
        expected = x / torch.tensor(d, dtype=torch.float32)
        wrong = _bits(got, equal_nan=True) != _bits(expected, equal_nan=True)
        assert not wrong.any(), (d, x[wrong][:3], got[wrong][:3], expected[wrong][:3])


def _float32s(first: float, last: float) -> torch.Tensor:
    """Every float32 from ``first`` up to ``last`` (not included), both non-negative."""
    low, high = (torch.tensor(v, dtype=torch.float32).view(torch.int32).item() for v in (first, last))
    return torch.arange(low, high, dtype=torch.int32).view(torch.float32)


def test_the_eager_float32_square_root_is_the_ieee_one():
    # sqrt(x * 4**k) is sqrt(x) * 2**k exactly, so [1, 4) holds every rounding case of the normal float32s; the
    # subnormals and the special values come besides (benchmarks/check_sqrt_exhaustive.py checks all 2**32)
    x = torch.cat(
        [
            _float32s(1.0, 4.0),
            _float32s(0.0, 2.0**-126),
            torch.tensor([-0.0, math.inf, -math.inf, math.nan, -1.0, -(2.0**-149), 2.0**127, 3.4028234e38]),
        ]
    )
    with numpy.errstate(invalid="ignore"):  # the roots of negative numbers: NaN
        expected = torch.from_numpy(numpy.sqrt(x.numpy()))
    for given in (x, x.clone().requires_grad_()):  # the path of plain tensors, and the one autograd records
        got = EagerOps.sqrt(given)
        wrong = _bits(got, equal_nan=True) != _bits(expected, equal_nan=True)
        assert got.dtype == torch.float32 and not wrong.any(), (x[wrong][:3], got[wrong][:3], expected[wrong][:3])


def _root_over(divisor: float) -> fadam.GradientTransformation:
    """The square root of each update's magnitude over a number from the prologue."""
    return elementwise(Elementwise("root_over", fadam.EmptyState, (), False, lambda count: {"d": divisor}, _root_body))


def _root_body(o, s, u, p):
    return (o.sqrt(o.abs(u)) / s.d,)


def test_adams_square_root_over_its_bias_correction_is_computed_without_a_division(kernel_runs):
    texts = []
    load = _cpu_kernel._load_source

    def spy(text, streamed=False):
        texts.append(text)
        return load(text, streamed)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_cpu_kernel, "_load_source", spy)
        _side_by_side(PROGRAMS["adam"](), _params(), steps=2, donate=True)
    assert texts and all("fadam_divide_root(" in text for text in texts)


@pytest.mark.parametrize("divisor", [0.3, -5.0, 2.0**-60, 2.0**60, 0.0, float("inf"), float("nan")])
def test_a_square_root_over_any_number_equals_the_eager_path(divisor, kernel_runs):
    # in range the kernel divides without a division; out of it (and for 0, inf, nan) it divides
    tx = fadam.chain(_root_over(divisor), _lr(1e-2))
    params = {key: leaf for key, leaf in _params().items() if key != "complex"}
    grads = _edge_grads(params)
    eager = _eager_step(tx, params, grads, tx.init(params))
    kernel = fadam.step(tx, _clone(params), grads, tx.init(params))
    assert kernel_runs == [2]
    assert _mismatches(kernel, eager) == []


# a factored leaf's two largest dims anywhere among its dims; leaves above the threading threshold; leaves that are
# not factored (a vector, a matrix with a dim under min_dim_size_to_factor)
FACTORED_SHAPES = {
    "rows": (40, 70),
    "columns": (70, 40),
    "batched": (3, 40, 70),
    "between": (40, 3, 70),
    "outer": (70, 3, 40),
    "inner": (40, 70, 3),
    "conv": (70, 40, 3, 3),
    "large": (300, 301),
    "vector": (1001,),
    "narrow": (2, 500),
}


@pytest.mark.parametrize("donate", [False, True], ids=["kept", "donated"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_factored_statistics_over_any_two_dims_equal_the_eager_path_bit_for_bit(dtype, donate, kernel_runs):
    """(bfloat16: ``PROGRAMS["adafactor"]`` on whole vectors of ATen's loops.)"""
    gen = torch.Generator().manual_seed(0)
    params = {name: torch.randn(shape, generator=gen).to(dtype) for name, shape in FACTORED_SHAPES.items()}
    tx = fadam.chain(
        fadam.scale_by_factored_rms(decay_rate=0.7, step_offset=2, min_dim_size_to_factor=3),
        fadam.trace(0.9),
        _lr(1e-2),
    )
    report = explain(tx, params)  # one line: every leaf takes the kernel
    assert report.startswith(f"scale_by_factored_rms -> trace -> scale_by_learning_rate: {KERNEL}: ")
    assert report.endswith(f"({len(params)} leaves)") and "\n" not in report
    _side_by_side(tx, params, steps=4, donate=donate)
    assert kernel_runs == [len(params)] * 4


@pytest.mark.parametrize("donate", [False, True], ids=["kept", "donated"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_torchs_adafactor_runs_its_two_stages_in_the_kernel_bit_for_bit(dtype, donate, kernel_runs):
    """Its moment's stage (statistics over the last two dims, then ``g / sqrt(row * col / mean)``) and its relative
    step's (the update's RMS clip and the params' RMS, which need the first stage's whole update), on one state."""
    gen = torch.Generator().manual_seed(0)
    params = {name: torch.randn(shape, generator=gen).to(dtype) for name, shape in FACTORED_SHAPES.items()}
    tx = fadam.adafactor_torch(_schedule, eps=(1e-20, 1e-2), d=1.5, weight_decay=0.1, maximize=True)
    report = explain(tx, params).splitlines()
    assert [line.split(":")[0] for line in report] == [
        "scale",  # maximize: its statistics read the negated gradient whole
        "scale_by_adafactor_torch",
        "scale_by_adafactor_torch's relative step -> add_decoupled_weight_decay",
    ]
    assert all(line.split(": ")[1] == KERNEL and f"({len(params)} leaves)" in line for line in report)
    _side_by_side(tx, params, steps=4, donate=donate)
    assert kernel_runs == [len(params)] * 3 * 4  # a call per segment


def test_a_factored_leaf_keeps_row_and_column_statistics_only():
    params = {"w": torch.zeros(40, 70), "b": torch.zeros(70)}
    state = fadam.scale_by_factored_rms(min_dim_size_to_factor=3).init(params)
    assert [tuple(state.v_row["w"].shape), tuple(state.v_col["w"].shape), tuple(state.v["w"].shape)] == [
        (40,),
        (70,),
        (1,),
    ]
    assert [tuple(state.v_row["b"].shape), tuple(state.v_col["b"].shape), tuple(state.v["b"].shape)] == [
        (1,),
        (1,),
        (70,),
    ]


@pytest.mark.parametrize("shape", [(4, 5), (4, 5, 6), (3, 1, 4), (7,), ()], ids=str)
def test_a_spread_reads_each_element_where_torch_broadcasts_it(shape):
    """``Spread.indexing``, which the kernels read a spread by, against ``Spread.over``, which the eager path
    broadcasts."""
    from fadam._program import Spread

    leaf = torch.zeros(shape)
    spreads = [Spread(torch.arange(float(leaf.numel())).reshape(shape)), Spread(torch.tensor(5.0))]
    for dim in range(len(shape)):
        for span in range(1, len(shape) - dim + 1):  # dims dim .. dim + span - 1 dropped
            dropped = [n for d, n in enumerate(shape) if not dim <= d < dim + span]
            spreads.append(Spread(torch.arange(float(math.prod(dropped))).reshape(dropped), dim, span))
    for spread in spreads:
        inner, count = spread.indexing(leaf.shape)
        at = torch.arange(leaf.numel())
        read = spread.values.reshape(-1)[(at // (inner * count)) * inner + at % inner]
        assert torch.equal(read, spread.over(leaf).expand(shape).reshape(-1)), (spread.dim, spread.span)


def test_explain_says_why_a_complex_leaf_keeps_its_factored_statistics_eager():
    params = {"w": torch.zeros(4, 5), "z": torch.zeros(4, 5, dtype=torch.complex64)}
    report = explain(fadam.scale_by_factored_rms(min_dim_size_to_factor=2), params)
    assert report.splitlines() == [
        "scale_by_factored_rms: eager: a complex leaf with spreads (factored statistics), which the kernel does not "
        "read: ['z']",
        f"scale_by_factored_rms: {KERNEL}: ['w']",
    ]


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_statistics_are_decoded_and_requantized_as_quantize_state_does(bits, kernel_runs):
    """``quantize_state`` keeps a large full second moment (a vector's) quantized; the executor decodes it for the
    statistics and requantizes the new one, as that wrapper's own update does."""
    gen = torch.Generator().manual_seed(0)
    params = {"v": torch.randn(513, generator=gen), "w": torch.randn(65, 257, generator=gen)}
    inner = fadam.chain(fadam.scale_by_factored_rms(min_dim_size_to_factor=3), _lr(1e-2))
    tx = fadam.quantize_state(inner, bits=bits, min_size=256)
    assert type(tx.init(params).inner_state[0].v["v"]).__name__ == "QuantizedArray"
    _side_by_side(tx, params, steps=3, donate=True)
    assert kernel_runs == [2] * 3
