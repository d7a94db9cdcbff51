"""The generated Triton kernel (``fadam._triton_kernel``), run on the CPU by Triton's interpreter, against the eager
path (``tx.update`` then ``apply_updates``), through the executor (``fadam.backend("triton")``).

The contract, per step: bit for bit, float32, float64 and bfloat16, updates, params and state, against the eager
path computing its square roots as the IEEE standard says (the kernel's, and numpy's in the interpreter), as it does
for float32 and bfloat16; against its float64 square root, torch's own on the CPU, MKL's, whose last bit differs for
1% of inputs or more, the state still bit for bit, the params within ``PARAM_ULPS`` ulps of the update beyond their
own rounding and the updates within ``UPDATE_ULPS`` ulps of their largest magnitude.
"""

import numpy
import optree
import pytest
import torch

import fadam
from fadam._cpu_kernel import Quantized, cache_dir
from fadam._execute import segments
from fadam._program import EagerOps, program_of, trace
from fadam.quantization._maps import MAP_IDS, encode_tables
from tests.ulps import param_ulps as _param_ulps
from tests.ulps import ulp as _ulp
from tests.ulps import ulps as _ulps

pytest.importorskip("triton")

from fadam import _triton_kernel

PARAM_ULPS = 2
UPDATE_ULPS = 4


@pytest.fixture(autouse=True, scope="module")
def _interpreted(tmp_path_factory: pytest.TempPathFactory):
    """Kernels are decorated for Triton's interpreter (read when their module is imported) and written to a
    temporary folder; both restored after the module, so no other test meets them."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        patch.setenv("FADAM_CACHE_DIR", str(tmp_path_factory.mktemp("fadam-triton")))
        _triton_kernel._load.cache_clear()
        yield
    _triton_kernel._load.cache_clear()


_lr = fadam.scale_by_learning_rate

PROGRAMS = {
    "adam": lambda: fadam.chain(fadam.scale_by_adam(), _lr(1e-2)),
    "adam-amsgrad": lambda: fadam.chain(fadam.scale_by_adam(amsgrad=True), _lr(1e-2)),
    "adam-nesterov": lambda: fadam.chain(fadam.scale_by_adam(nesterov=True), _lr(1e-2)),
    "adamw": lambda: fadam.chain(fadam.scale_by_adam(), fadam.add_decayed_weights(0.1), _lr(1e-2)),
    "lion": lambda: fadam.chain(fadam.scale_by_lion(), _lr(1e-3)),
    "momentum-nesterov": lambda: fadam.chain(fadam.trace(0.9, nesterov=True), _lr(1e-2)),
    "momentum-dampening": lambda: fadam.chain(fadam.trace(0.9, dampening=0.3), _lr(1e-2)),
    "clip": lambda: fadam.chain(fadam.clip(0.5), _lr(1e-2)),
    "clip_by_global_norm": lambda: fadam.chain(fadam.clip_by_global_norm(1.0), fadam.trace(0.9), _lr(1e-1)),
    "rms-rsqrt": lambda: fadam.chain(fadam.scale_by_rms(eps_in_sqrt=True), _lr(1e-2)),
    "lamb": lambda: fadam.lamb(1e-2, weight_decay=0.1),  # per-leaf trust ratios, in a second segment
    "adafactor": lambda: fadam.adafactor(1e-2, min_dim_size_to_factor=2),  # row and column factors: spreads
    "adafactor_torch": lambda: fadam.adafactor_torch(1e-2, weight_decay=0.1),  # two stages on one state
}
TAKE_SQUARE_ROOTS = {"adam", "adam-amsgrad", "adam-nesterov", "adamw", "lamb"}  # rsqrt: 1 / the IEEE one, on the CPU
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def _params(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Several blocks with a ragged tail, exactly one block, a small matrix and an empty leaf: one launch for all.
    bfloat16 leaves are whole vectors of ATen's loops, whose rounding the kernels follow: on a scalar tail ATen rounds
    some ops otherwise (``tests/test_program.py``'s ``_bfloat16_params``)."""
    gen = torch.Generator().manual_seed(0)
    ragged = dtype != torch.bfloat16
    sizes = {
        "big": (2500 if ragged else 2560,),
        "block": (_triton_kernel.BLOCK,),
        "matrix": (3, 5) if ragged else (4, 64),
        "empty": (0,),
    }
    return {name: torch.randn(shape, generator=gen).to(dtype) for name, shape in sizes.items()}


def _grads(params: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Magnitudes from 1e-6 to 1e3, with zeros and negative zeros at places that move with ``seed``."""
    gen = torch.Generator().manual_seed(seed)

    def leaf(p: torch.Tensor) -> torch.Tensor:
        g = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        g = (g * 10.0 ** torch.randint(-6, 4, p.shape, generator=gen)).to(p.dtype)
        g.view(-1)[seed % 7 :: 7] = 0.0
        g.view(-1)[seed % 5 :: 11] = -0.0
        return g

    return {name: leaf(p) for name, p in params.items()}


def _eager(tx, params, grads, state):
    """The eager path's updates, new params and new state."""
    with fadam.backend("eager"):
        updates, state = tx.update(grads, state, params)
    return updates, fadam.apply_updates(params, updates), state


def _kernel(tx, params, grads, state, applies: bool, kernel_runs: list[int] | None = None, donate: bool = False):
    """``tx``'s updates (``applies``: its new params, by ``fadam.step``, donating them and the state where
    ``donate``) and new state on the Triton backend, as ``fadam._execute`` runs it: per segment, one launch over every
    leaf (each launch's leaf count goes to ``kernel_runs``)."""
    run = _triton_kernel.TritonKernel.run

    def counted(kernel, rows, scalars, leaf_scalars):
        if kernel_runs is not None:
            kernel_runs.append(len(rows))
        return run(kernel, rows, scalars, leaf_scalars)

    with pytest.MonkeyPatch.context() as patch, fadam.backend("triton"):
        patch.setattr(_triton_kernel.TritonKernel, "run", counted)
        return fadam.step(tx, params, grads, state, donate=donate) if applies else tx.update(grads, state, params)


def _largest_ulps(kernel, eager, what: str) -> dict[str, int]:
    """Per leaf, the largest distance in ulps between the two paths' trees."""
    assert optree.tree_structure(kernel) == optree.tree_structure(eager)
    paths = optree.tree_paths(eager)
    return {
        f"{what} {path}": _ulps(a, b)
        for path, a, b in zip(paths, optree.tree_leaves(kernel), optree.tree_leaves(eager))
    }


def _normwise_ulps(kernel: torch.Tensor, eager: torch.Tensor) -> int:
    """The largest difference between two leaves in ulps of the eager leaf's largest magnitude."""
    if eager.numel() == 0 or _ulps(kernel, eager) == 0:
        return 0
    scale = _ulp(eager.abs().max().reshape(1))
    return int(torch.ceil((kernel.double() - eager.double()).abs().max() / scale))


def _differences(tx, params, grads, state, kernel_runs: list[int] | None = None) -> dict[str, int]:
    """The kernel's largest distance from the eager path, per leaf: its updates and its new state (run as ``update``
    and as a step that applies the update) in ulps, its updates also in ulps of their largest magnitude ("norm"), its
    new params in ulps of the update (``_param_ulps``)."""
    updates, new_params, new_state = _eager(tx, params, grads, state)
    kernel_updates, kernel_state = _kernel(tx, params, grads, state, False, kernel_runs)
    kernel_params, applied_state = _kernel(tx, params, grads, state, True, kernel_runs)
    found = _largest_ulps(kernel_updates, updates, "update")
    found |= _largest_ulps(kernel_state, new_state, "state")
    found |= _largest_ulps(applied_state, new_state, "state (applied)")
    for name in params:
        found[f"norm {name}"] = _normwise_ulps(kernel_updates[name], updates[name])
        found[f"param {name}"] = _param_ulps(kernel_params[name], new_params[name], updates[name])
    return found


def _numpy_sqrt(x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(numpy.sqrt(x.numpy()))  # the IEEE square root, as the kernel's


@pytest.fixture
def ieee_sqrt(monkeypatch):
    """The eager path with the IEEE square root for float64 too, where it takes torch's CPU one, MKL's (its last
    bit differs for 1% of inputs or more), so that it computes as the kernel does. Float32's and bfloat16's are left
    as they are, IEEE ones on both paths: the float32 and bfloat16 rows below check that with no patch."""
    sqrt = EagerOps.sqrt
    monkeypatch.setattr(
        EagerOps, "sqrt", staticmethod(lambda x: _numpy_sqrt(x) if x.dtype == torch.float64 else sqrt(x))
    )


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_three_steps_equal_the_eager_path_bit_for_bit(name, dtype, ieee_sqrt):
    tx = PROGRAMS[name]()
    params = _params(dtype)
    runs = _steps_equal_the_eager_path(tx, params, steps=3)
    segment_count = len(segments(program_of(tx).expanded(tx.init(params))[0]))
    assert runs == [len(params)] * (3 * 2 * segment_count)  # one launch per segment for all the leaves


def _steps_equal_the_eager_path(tx, params, steps: int) -> list[int]:
    """Asserts that each of ``steps`` steps from the eager path's trajectory gives its numbers bit for bit, as an
    update and as an applied step; returns each launch's leaf count."""
    state = tx.init(params)
    runs: list[int] = []
    for step in range(steps):
        grads = _grads(params, seed=step)
        found = _differences(tx, params, grads, state, runs)
        assert max(found.values()) == 0, f"step {step}: {found}"
        _, params, state = _eager(tx, params, grads, state)
    return runs


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_factored_statistics_over_any_two_dims_equal_the_eager_path_bit_for_bit(dtype):
    """A factored leaf's row and column factors broadcast along its two largest dims, wherever they lie."""
    shapes = {"rows": (6, 9), "columns": (9, 6), "batched": (2, 6, 9), "outer": (9, 2, 6), "inner": (6, 9, 2)}
    gen = torch.Generator().manual_seed(1)
    params = {name: torch.randn(shape, generator=gen).to(dtype) for name, shape in shapes.items()}
    tx = fadam.chain(fadam.scale_by_factored_rms(min_dim_size_to_factor=3), _lr(1e-2))
    assert _steps_equal_the_eager_path(tx, params, steps=2) == [len(params)] * 4


@pytest.mark.parametrize("name", [name for name in PROGRAMS if name in TAKE_SQUARE_ROOTS])
def test_with_torchs_float64_square_root_each_step_stays_within_the_bound(name):
    """Against torch's own (MKL's) float64 square root: the state bit for bit (no slot here depends on a square
    root), the params within ``PARAM_ULPS`` ulps of the update beyond their own rounding, the updates within
    ``UPDATE_ULPS`` ulps of their largest magnitude (element by element, weight decay cancelling Adam's direction can
    make a last-bit difference in a square root many ulps of a small update). Each step starts both paths alike: the
    bound is per step."""
    tx = PROGRAMS[name]()
    params = _params(torch.float64)
    state = tx.init(params)
    for step in range(3):
        grads = _grads(params, seed=step)
        found = _differences(tx, params, grads, state)
        assert max(v for k, v in found.items() if k.startswith("state")) == 0, f"step {step}: {found}"
        assert max(v for k, v in found.items() if k.startswith("param")) <= PARAM_ULPS, f"step {step}: {found}"
        assert max(v for k, v in found.items() if k.startswith("norm")) <= UPDATE_ULPS, f"step {step}: {found}"
        _, params, state = _eager(tx, params, grads, state)


def test_torchs_float64_square_root_does_differ_from_the_kernels():
    """The bound above is met, not vacuous: a leaf of 20k elements meets some of MKL's differences."""
    if not torch.backends.mkl.is_available():
        pytest.skip("torch without MKL: its CPU square root is the IEEE one, and the kernel equals it bit for bit")
    tx = PROGRAMS["adam"]()
    gen = torch.Generator().manual_seed(1)
    params = {"w": torch.randn(20_000, generator=gen, dtype=torch.float64)}
    grads = {"w": torch.randn(20_000, generator=gen, dtype=torch.float64)}
    found = _differences(tx, params, grads, tx.init(params))
    assert found["update ('w',)"] > 0, found


def _edge_grads(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Infinities, NaN, signed zeros, huge and tiny values among ordinary gradients."""
    grads = _grads(params, seed=3)
    edges = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 3e38, -3e38, 1e-40, -1e-45])
    for g in grads.values():
        flat = g.view(-1)
        flat[: min(flat.numel(), edges.numel())] = edges[: flat.numel()].to(g.dtype)
    return grads


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's NaN from inf - inf
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("name", ["adam-amsgrad", "lion", "clip", "momentum-nesterov"])
def test_inf_nan_and_signed_zeros_equal_the_eager_path(name, dtype, ieee_sqrt):
    """maximum, sign, clamp and the multiply-adds meet every special value as torch's ops do (NaNs equal NaNs)."""
    tx = PROGRAMS[name]()
    params = _params(dtype)
    found = _differences(tx, params, _edge_grads(params), tx.init(params))
    assert max(found.values()) == 0, found


def test_kernels_are_written_under_fadam_cache_dir():
    traced = trace(tuple(s.decl for s in program_of(PROGRAMS["lion"]()).stages), True)
    dtypes = (torch.float32,) * len(traced.graph.inputs)
    text, _ = _triton_kernel.source(traced, dtypes, True)
    _triton_kernel.load(traced, dtypes)
    written = list((cache_dir() / "triton").glob("fadam_*.py"))
    assert text in [path.read_text() for path in written]


def test_formats_and_dtypes_the_kernel_does_not_generate_are_refused():
    traced = trace(tuple(s.decl for s in program_of(PROGRAMS["adam"]()).stages), True)
    dtypes = (torch.float32,) * len(traced.graph.inputs)
    assert _triton_kernel.supports((None, None))
    assert _triton_kernel.supports((Quantized(8, 256, 0), Quantized(8, 256, 1)))
    assert _triton_kernel.supports((Quantized(4, 6, 2), None))  # a block of any even size
    assert not _triton_kernel.supports((Quantized(8, 256, 0), Quantized(8, 128, 1)))  # one block size a kernel
    assert not _triton_kernel.supports((Quantized(2, 256, 0), None))
    assert not _triton_kernel.supports((Quantized(4, 7, 2), None))  # 4-bit codes of a block fill whole bytes
    assert not _triton_kernel.supports((Quantized(8, _triton_kernel.LARGEST_BLOCK + 2, 0), None))
    assert _triton_kernel.load(traced, dtypes, (Quantized(8, 255, 0), None)) is None
    assert _triton_kernel.load(traced, (torch.float16,) * len(dtypes)) is None
    assert _triton_kernel.load(traced, dtypes, (None, None)) is not None


def test_a_leaf_scalar_count_that_does_not_match_the_leaves_is_refused():
    tx = PROGRAMS["lamb"]()
    program = program_of(tx)
    traced = trace(tuple(s.decl for s in segments(program)[1].stages), True)
    kernel = _triton_kernel.load(traced, (torch.float32,) * len(traced.graph.inputs))
    row = [torch.ones(3), torch.ones(3), torch.empty(3)]
    with pytest.raises(ValueError, match="scalars per leaf"):
        kernel.run([row, row], [0.1] * len(traced.graph.scalars), [1.0] * len(traced.graph.leaf_scalars))


def test_explain_names_the_triton_kernel_and_why_a_leaf_stays_eager():
    params = {"big": torch.randn(5000), "small": torch.randn(8), "half": torch.randn(8, dtype=torch.float16)}
    tx = fadam.lion8bit(1e-3)  # "big" gets 8-bit moments, "small" full-precision ones: one kernel each
    with fadam.backend("triton"):
        found = fadam.explain(tx, params)
        huge = fadam.quantize_state(fadam.scale_by_lion(), block_size=_triton_kernel.LARGEST_BLOCK + 2, min_size=0)
        too_large = fadam.explain(huge, {"w": torch.randn(8)})
    assert found.splitlines() == [
        "scale_by_lion -> scale_by_learning_rate: eager: torch.float16 (the kernel takes float32, float64 and"
        " bfloat16): ['half']",
        "scale_by_lion -> scale_by_learning_rate: generated Triton kernel: ['big'], ['small']",
    ]
    assert too_large == (
        "scale_by_lion: eager: quantized state in blocks of 1048578 elements, more than a Triton program holds: ['w']"
    )


def test_without_the_interpreter_cpu_leaves_run_eagerly_on_the_triton_backend(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    params = {"w": torch.randn(4)}
    tx = fadam.lion(1e-3)
    with fadam.backend("triton"):
        assert fadam.explain(tx, params).endswith(
            "eager: on the CPU, where Triton runs only under TRITON_INTERPRET=1 (its interpreter): ['w']"
        )
        launches: list[int] = []
        grads = {"w": torch.randn(4)}
        kernel_params, _ = _kernel(tx, params, grads, tx.init(params), True, launches)
    assert launches == []
    assert torch.equal(kernel_params["w"], _eager(tx, params, grads, tx.init(params))[1]["w"])


def test_a_partition_runs_each_branch_in_one_launch_and_equals_the_eager_path():
    params = _params(torch.float32)
    labels = {"big": "lion", "block": "sgd", "matrix": "lion", "empty": "sgd"}
    tx = fadam.partition({"lion": fadam.lion(1e-3), "sgd": fadam.sgd(1e-2, momentum=0.9, nesterov=True)}, labels)
    state = tx.init(params)
    launches: list[int] = []
    for step in range(2):
        grads = _grads(params, seed=step)
        found = _differences(tx, params, grads, state, launches)
        assert max(found.values()) == 0, f"step {step}: {found}"
        _, params, state = _eager(tx, params, grads, state)
    assert launches == [2] * 8  # each step's update and step: per branch, one launch for its two leaves


QUANTIZED = {
    "adamw8bit": lambda: fadam.adamw8bit(1e-2, weight_decay=0.1, min_size=0),
    "lion8bit": lambda: fadam.lion8bit(1e-3, weight_decay=0.1, min_size=0),
    "adam4bit": lambda: fadam.adam4bit(1e-2, min_size=0),
    "sgd8bit": lambda: fadam.sgd8bit(1e-2, momentum=0.9, nesterov=True, min_size=0),
    "trace-rms-4bit-block-6": lambda: fadam.chain(  # a block that is not a power of two
        fadam.quantize_state(fadam.chain(fadam.trace(0.9), fadam.scale_by_rms()), bits=4, block_size=6, min_size=0),
        _lr(1e-2),
    ),
}


def _quantized_params(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Two leaves in one launch, both quantized (``min_size=0``): one of several blocks with a ragged last one, one
    smaller than a block. float32 ones of odd sizes (at 4 bits, a last byte holding one code); bfloat16 ones whole
    vectors of ATen's loops (``_params``)."""
    gen = torch.Generator().manual_seed(0)
    sizes = {"big": (3, 101), "small": (11,)} if dtype == torch.float32 else {"big": (5, 64), "small": (32,)}
    return {name: torch.randn(shape, generator=gen).to(dtype) for name, shape in sizes.items()}


def _quantized(state) -> list[fadam.QuantizedArray]:
    return [q for q in optree.tree_leaves(state, is_leaf=_is_quantized) if _is_quantized(q)]


def _is_quantized(node) -> bool:
    return type(node) is fadam.QuantizedArray


def _side_by_side(tx, params, state, grads: list[dict[str, torch.Tensor]]):
    """A step per entry of ``grads`` on the eager path and on the Triton backend from the same start (the kernel's
    steps kept, then donated, in turn), the params and the state (codes, absmax, map ids) asserted equal bit for bit
    after each, with one launch a step for all the leaves; the eager path's last params and state."""
    eager = (params, state)
    kernel = optree.tree_map(torch.clone, eager)
    launches: list[int] = []
    for step, given in enumerate(grads):
        with fadam.backend("eager"):
            eager = fadam.step(tx, eager[0], given, eager[1])
        kernel = _kernel(tx, kernel[0], given, kernel[1], True, launches, donate=step % 2 == 1)
        found = _largest_ulps(kernel, eager, "")
        assert max(found.values()) == 0, f"step {step}: {found}"
    assert launches == [len(params)] * len(grads)
    return eager


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(QUANTIZED))
def test_quantized_state_steps_equal_the_eager_path_bit_for_bit(name, dtype, ieee_sqrt):
    """The kernel decodes its quantized slots' blocks, runs the body and encodes the new blocks with each slot's map
    as the eager path's codec does: params, codes, scales and map ids bit for bit."""
    tx = QUANTIZED[name]()
    params = _quantized_params(dtype)
    state = tx.init(params)
    assert len(_quantized(state)) >= len(params)
    _side_by_side(tx, params, state, [_grads(params, seed=step) for step in range(2)])


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's NaN from inf - inf
@pytest.mark.parametrize("name", ["adamw8bit", "adam4bit"])
def test_quantized_state_meets_inf_nan_and_signed_zeros_as_the_eager_path(name, ieee_sqrt):
    """An infinity sets its block's negated scale and a NaN is stored as 0, in the kernel as in the codec."""
    tx = QUANTIZED[name]()
    params = _quantized_params(torch.float32)
    with fadam.backend("eager"):
        params, state = fadam.step(tx, params, _grads(params, seed=0), tx.init(params))
    params, state = _side_by_side(tx, params, state, [_edge_grads(params)])
    assert any(bool((q.absmax < 0).any()) for q in _quantized(state))  # a block holding an infinity was met


def test_an_unknown_map_id_is_refused_before_anything_changes():
    tx = QUANTIZED["adamw8bit"]()
    params = _quantized_params(torch.float32)
    state = tx.init(params)
    state[0].inner_state.mu["small"].map_id.fill_(9)
    before = optree.tree_map(torch.clone, (params, state))
    with pytest.raises(ValueError, match="unknown map"):
        _kernel(tx, params, _grads(params, seed=0), state, True, donate=True)
    assert max(_largest_ulps((params, state), before, "").values()) == 0


@pytest.mark.parametrize("bits", [8, 4])
def test_values_at_the_midpoints_between_codes_take_the_codecs_codes(bits):
    """A momentum's first step stores the gradient itself: in blocks of absmax 1, at every midpoint between two of
    the signed map's codes (in one block) and at their negatives (in the other), each tie takes the codec's code (the
    lower one)."""
    block = 256
    tx = fadam.chain(fadam.quantize_state(fadam.trace(0.9), bits=bits, block_size=block, min_size=0), _lr(1e-2))
    midpoints = encode_tables()[1][MAP_IDS[f"dynamic{bits}_signed"]]
    midpoints = torch.cat([torch.ones(1), midpoints[midpoints.isfinite()]])
    half = torch.nn.functional.pad(midpoints, (0, block - midpoints.numel()))
    grads = {"w": torch.cat([half, -half])}
    params = {"w": torch.zeros_like(grads["w"])}
    _, state = _side_by_side(tx, params, tx.init(params), [grads])
    assert torch.equal(_quantized(state)[0].absmax, torch.ones(2))
