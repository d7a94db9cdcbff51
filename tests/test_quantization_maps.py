import pytest
import torch

from fadam.quantization import dynamic_map, linear_nonzero_map
from fadam.quantization._maps import MAP_IDS, code_maps, decode, encode
from tests import kernel_functions

LENGTHS = {"dynamic8_signed": 255, "dynamic8_unsigned": 256, "dynamic4_signed": 15, "linear4_nonzero": 16}


def test_dynamic_maps_shape_and_range():
    signed, unsigned, signed4 = dynamic_map(True, 8), dynamic_map(False, 8), dynamic_map(True, 4)
    assert (signed.numel(), unsigned.numel(), signed4.numel()) == (255, 256, 15)
    for m in (signed, unsigned, signed4):
        assert bool((m[1:] > m[:-1]).all())  # sorted, distinct
        assert m.max().item() == 1.0 and bool((m == 0).any())
    assert torch.equal(signed, -signed.flip(0))  # symmetric
    assert unsigned.min().item() == 0.0 and unsigned[1].item() == pytest.approx(1e-7)
    top = lambda m: int(((m > 0.1) & (m <= 1)).sum())  # noqa: E731
    assert (top(unsigned), top(signed), top(signed4)) == (128, 65, 4)
    assert signed[signed > 0].min().item() == pytest.approx(5.5e-6)
    for k in range(6):  # every decade ends at its power of ten
        assert bool((signed == torch.tensor(10.0**-k)).any())
        assert bool((unsigned == torch.tensor(10.0**-k)).any())


def test_linear_nonzero_map_has_no_zero():
    m = linear_nonzero_map(4)
    assert m.numel() == 16 and m.min().item() == 1 / 16 and m.max().item() == 1.0


@pytest.mark.parametrize("name", list(MAP_IDS))
def test_encode_is_nearest_code_and_decode_inverts_it(name):
    torch.manual_seed(0)
    map_id = MAP_IDS[name]
    values = code_maps()[map_id, : LENGTHS[name]]
    mids = (values[:-1] + values[1:]) / 2
    lo = -1.0 if "signed" in name and "unsigned" not in name else 0.0
    y = torch.cat(
        [
            torch.rand(20000) * (1 - lo) + lo,
            torch.sign(torch.randn(20000)) * 10 ** (-9 * torch.rand(20000)),  # every decade
            torch.nextafter(mids, torch.tensor(2.0)),
            torch.nextafter(mids, torch.tensor(-2.0)),
            values,
            torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30]),
        ]
    ).clamp(lo, 1.0)
    codes = encode(y, map_id)
    nearest = torch.bucketize(y, mids)
    off = codes.long() != nearest
    # only values within float rounding of a midpoint may take the other neighbour, never a farther code
    gap = (y[off, None] - mids[None]).abs().amin(dim=1)
    assert bool((gap <= 1e-6 * y[off].abs() + 1e-12).all())
    assert bool(((codes.long() - nearest).abs() <= 1).all())
    assert torch.equal(encode(values, map_id).long(), torch.arange(values.numel()))  # codes round-trip exactly
    assert torch.equal(decode(torch.arange(values.numel()), map_id), values)


def test_bad_maps():
    with pytest.raises(ValueError):
        dynamic_map(False, 4)
    with pytest.raises(ValueError):
        linear_nonzero_map(8)


def _encoder_inputs(name: str) -> torch.Tensor:
    """Every midpoint of the map, every code value and powers of ten, each with 4 neighbours each side, random values
    of every scale, zeros and the ends of [-1, 1]: both signs."""
    torch.manual_seed(0)
    map_id = MAP_IDS[name]
    values = code_maps()[map_id, : LENGTHS[name]]
    edges = torch.cat([(values[:-1] + values[1:]) / 2, values, 10.0 ** -torch.arange(10.0)])
    patterns = torch.arange(0x3000, 0x3F81, dtype=torch.int32) << 16  # the first and last float of each bfloat16
    pattern_ends = torch.cat([patterns, patterns | 0xFFFF]).view(torch.float32)
    near = [edges]
    for direction in (2.0, -2.0):
        step = edges
        for _ in range(4):  # 4 ulps each side
            step = torch.nextafter(step, torch.tensor(direction))
            near.append(step)
    y = torch.cat(
        [
            *near,
            torch.rand(100000) * 2 - 1,
            torch.sign(torch.randn(100000)) * 10 ** (-12 * torch.rand(100000)),
            torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30, 1e-45, -1e-45]),
            pattern_ends,
        ]
    ).clamp(-1.0, 1.0)
    return torch.cat([y, -y])


@pytest.mark.parametrize("name", list(MAP_IDS))
def test_static_encoder_matches_table_encoder(name):
    # The eager codec encodes with a static map id (arithmetic guess + one midpoint read) or a 0-d tensor
    # (bfloat16-bucket table): the codes must agree on every input, above all at and around each midpoint.
    # benchmarks/check_encoder_exhaustive.py checks every float32 in [-1, 1].
    map_id = MAP_IDS[name]
    y = _encoder_inputs(name)
    table = encode(y, torch.tensor(map_id, dtype=torch.uint8))
    static = encode(y, map_id)
    assert static.dtype == torch.int32
    assert torch.equal(static, table), y[static != table][:5]


@pytest.mark.parametrize("name", list(MAP_IDS))
def test_kernel_encoder_matches_table_encoder(name):
    # The generated CPU kernel encodes with one read of a table of its own per bfloat16 pattern and an addition
    # (fadam._cpu_kernel._encoder_table); benchmarks/check_encoder_exhaustive.py checks every float32 in [-1, 1].
    if not kernel_functions.available():
        pytest.skip("no C++ compiler")
    map_id = MAP_IDS[name]
    y = _encoder_inputs(name)
    table = encode(y, torch.tensor(map_id, dtype=torch.uint8))
    kernel = kernel_functions.kernel_encode(y, map_id)
    assert torch.equal(kernel, table), y[kernel != table][:5]
