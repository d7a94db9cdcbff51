import pytest
import torch
from torch.func import vmap

from fadam.quantization import dequantize_blockwise, dynamic_map, quantize_blockwise
from fadam.quantization._codec import QuantizedArray, expected_sizes
from fadam.quantization._maps import MAP_IDS, code_maps, encode, tables_on

INF, NAN = float("inf"), float("nan")


def roundtrip(x, bits=8, block=256):
    q = quantize_blockwise(x, bits, block)
    return q, dequantize_blockwise(q, x.shape, bits, block)


@pytest.mark.parametrize(("bits", "block"), [(8, 256), (8, 2048), (4, 128)])
def test_sizes_and_dtypes(bits, block):
    x = torch.randn(1000, 7)
    q = quantize_blockwise(x, bits, block)
    assert q.codes.dtype == torch.uint8 and q.absmax.dtype == torch.float32 and q.map_id.dtype == torch.uint8
    assert (q.codes.numel(), q.absmax.numel()) == expected_sizes(7000, bits, block)
    assert q.map_id.dim() == 0


def test_error_is_within_half_a_code_step():
    torch.manual_seed(0)
    x = torch.randn(4096) * torch.logspace(-3, 0, 4096)
    _, y = roundtrip(x)
    blocks_absmax = x.abs().view(-1, 256).amax(1).repeat_interleave(256)
    m = dynamic_map(True, 8)
    # largest gap between neighbouring codes, relative to absmax, bounds the error per element
    assert bool(((y - x).abs() <= (m[1:] - m[:-1]).max() / 2 * blocks_absmax + 1e-12).all())
    assert (y - x).norm() / x.norm() < 0.015
    # the element at each block's absmax is exact
    top = x.abs().view(-1, 256).argmax(1) + torch.arange(16) * 256
    assert torch.equal(y[top], x[top])


def test_non_negative_tensor_uses_unsigned_map_with_twice_the_resolution():
    torch.manual_seed(0)
    v = torch.rand(8192) ** 2
    q_unsigned, y_unsigned = roundtrip(v)
    q_signed, y_signed = roundtrip(torch.cat([v[:-1], -v[-1:]]))
    assert int(q_unsigned.map_id) == 1 and int(q_signed.map_id) == 0
    assert (y_unsigned - v).norm() < 0.6 * (y_signed[:-1] - v[:-1]).norm()


def test_zero_tensor():
    for bits in (8, 4):
        q, y = roundtrip(torch.zeros(5000), bits, 128)
        assert torch.equal(y, torch.zeros(5000)) and torch.equal(q.absmax, torch.zeros_like(q.absmax))


@pytest.mark.parametrize("bits", [8, 4])
def test_constant_blocks_are_exact(bits):
    x = torch.cat([torch.full((256,), 3.5), torch.full((256,), -0.125), torch.full((100,), 1e-20)])
    _, y = roundtrip(x, bits, 128)
    assert torch.equal(y, x)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n", [1, 127, 255, 257, 1001])
def test_sizes_not_a_multiple_of_the_block(bits, n):
    torch.manual_seed(n)
    x = torch.randn(n)
    q, y = roundtrip(x, bits, 128)
    assert y.shape == x.shape and q.absmax.numel() == -(-n // 128)
    tol = 0.015 if bits == 8 else 0.2
    assert ((y - x).norm() / x.norm()).item() < tol


def test_non_contiguous_and_bf16_inputs():
    torch.manual_seed(0)
    x = torch.randn(64, 96).t()
    assert not x.is_contiguous()
    _, y = roundtrip(x)
    _, y_ref = roundtrip(x.contiguous())
    assert torch.equal(y, y_ref)
    xb = x.to(torch.bfloat16)
    _, yb = roundtrip(xb)
    assert yb.dtype == torch.float32 and ((yb - xb.float()).norm() / xb.float().norm()) < 0.015


def test_nan_is_stored_as_zero_and_never_sets_the_scale():
    torch.manual_seed(0)
    x = torch.randn(512)
    bad = x.clone()
    bad[3], bad[300] = NAN, NAN
    q, y = roundtrip(bad)
    assert torch.equal(q.absmax, roundtrip(torch.where(bad.isnan(), 0.0, bad))[0].absmax)
    assert y[3] == 0 and y[300] == 0
    assert torch.equal(y, roundtrip(torch.where(bad.isnan(), 0.0, bad))[1])


@pytest.mark.parametrize(("bits", "block"), [(8, 256), (4, 128)])
def test_infinities_round_trip_and_the_block_keeps_its_finite_entries(bits, block):
    torch.manual_seed(bits)
    x = torch.randn(2 * block)
    bad = x.clone()
    bad[3], bad[7], bad[9] = INF, -INF, NAN  # all in block 0; block 1 is finite
    q, y = roundtrip(bad, bits, block)
    finite_max = torch.where(bad.isfinite(), bad.abs(), 0.0)[:block].max()
    assert q.absmax[0] == -finite_max and q.absmax[1] == x[block:].abs().max()  # the flag: a negated scale
    assert y[3] == INF and y[7] == -INF and y[9] == 0
    assert torch.equal(y[block:], roundtrip(x[block:], bits, block)[1])  # the finite block as if alone
    finite = bad[:block].isfinite()
    finite[9] = False
    # finite entries: the map's resolution over [-absmax, absmax], none decoded as an infinity
    values = code_maps()[int(q.map_id), 256:]
    steps = values[values.isfinite()].diff().max() * finite_max
    assert bool(((y[:block] - bad[:block]).abs()[finite] <= steps / 2 * (1 + 1e-6)).all())
    argmax = torch.where(finite, bad[:block].abs(), 0.0).argmax()
    assert y[argmax] == bad[argmax]  # the largest finite entry is exact, as in a finite block


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_block_of_infinities_decodes_as_infinities(bits, sign):
    x = torch.full((256,), sign * INF)
    x[:5] = 0.0
    q, y = roundtrip(x, bits, 128)
    assert torch.equal(q.absmax, torch.full((2,), -torch.finfo(torch.float32).tiny))  # a finite reciprocal
    assert torch.equal(y[5:], x[5:])
    if not (bits == 4 and sign > 0):  # the zero-free 4-bit map decodes 0 as a sixteenth of the scale
        assert torch.equal(y[:5], torch.zeros(5))
    assert bool((y[:5].abs() < 1e-38).all())


def test_tiny_entries_next_to_an_infinity_stay_finite():
    # 1 / 1e-40 overflows: the block's scale is raised to 2**-126, so its finite entries never encode as +-1 (inf)
    x = torch.tensor([1e-40, -3e-41, 0.0, INF])
    q, y = roundtrip(x, bits=8, block=4)
    assert q.absmax.item() == -torch.finfo(torch.float32).tiny
    assert y[3] == INF and bool(y[:3].isfinite().all())
    assert y[0] > 0 and y[1] < 0 and y[2] == 0


def test_blocks_normalise_by_the_absmax_reciprocal():
    # x * (1 / absmax), as bitsandbytes normalises: next to a midpoint it can round across it where x / absmax does not
    absmax = torch.tensor(3.0)
    mids = tables_on("cpu")[2][MAP_IDS["dynamic8_signed"]]
    mids = mids[mids.isfinite() & (mids > 0)]
    near = ((mids * absmax).view(torch.int32).unsqueeze(1) + torch.arange(-4, 5)).reshape(-1).view(torch.float32)
    x = torch.cat([absmax.reshape(1), near[near < absmax]])
    signed = torch.tensor(MAP_IDS["dynamic8_signed"], dtype=torch.uint8)
    q = quantize_blockwise(x, bits=8, block_size=x.numel(), map_id=signed)
    assert torch.equal(q.codes.to(torch.int32), encode(x * absmax.reciprocal(), signed))
    assert not torch.equal(q.codes.to(torch.int32), encode((x / absmax).clamp(max=1.0), signed))


def test_a_block_with_no_finite_absmax_reciprocal_stores_nonzero_entries_as_absmax():
    x = torch.tensor([1e-40, -3e-41, 0.0, 2e-42])  # absmax below 2**-128: 1 / absmax overflows to inf
    q, y = roundtrip(x, bits=8, block=4)
    assert q.absmax.item() == x[0].item()
    assert torch.equal(y, torch.tensor([1e-40, -1e-40, 0.0, 1e-40]))


def test_4bit_zero_free_map_keeps_small_second_moments_positive():
    v = torch.cat([torch.full((64,), 1e-12), torch.full((64,), 1.0)])  # one block of 128 with a huge dynamic range
    q, y = roundtrip(v, 4, 128)
    assert int(q.map_id) == 3 and bool((y > 0).all())
    m = torch.zeros(128)
    m[:64] = 1e-6
    step = m / (y.sqrt() + 1e-8)  # with a zero code this would be 1e-6 / 1e-8 = 100
    assert step.abs().max() < 1e-4


@pytest.mark.parametrize("bits", [8, 4])
def test_vmap_gives_each_member_its_own_blocks(bits):
    torch.manual_seed(0)
    stacked = torch.randn(3, 1000) * torch.tensor([[1e-4], [1.0], [1e3]])
    stacked[1] = stacked[1].abs()  # one member non-negative: its own map
    q = vmap(lambda x: quantize_blockwise(x, bits, 128))(stacked)
    y = vmap(lambda c, a, i, like: dequantize_blockwise(QuantizedArray(c, a, i, like), (1000,), bits, 128))(*q)
    for k in range(3):
        qk = quantize_blockwise(stacked[k], bits, 128)
        assert torch.equal(q.codes[k], qk.codes) and torch.equal(q.absmax[k], qk.absmax)
        assert torch.equal(q.map_id[k], qk.map_id)
        assert torch.equal(y[k], dequantize_blockwise(qk, (1000,), bits, 128))


@pytest.mark.parametrize("bits", [8, 4])
def test_vmap_keeps_each_members_infinities(bits):
    torch.manual_seed(0)
    stacked = torch.randn(2, 300)
    stacked[1, 7] = INF
    q = vmap(lambda x: quantize_blockwise(x, bits, 128))(stacked)
    y = vmap(lambda *q: dequantize_blockwise(QuantizedArray(*q), None, bits, 128))(*q)
    assert bool(y[0].isfinite().all()) and y[1, 7] == INF and int((~y.isfinite()).sum()) == 1
    assert torch.equal(q.absmax[1], quantize_blockwise(stacked[1], bits, 128).absmax)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(64, 128), (8192,), (), (3, 0, 2), (0,)])
def test_a_quantized_array_keeps_its_shape_as_an_empty_tensor(shape, bits):
    x = torch.randn(shape)
    q = quantize_blockwise(x, bits)
    assert q.shape == x.shape and q.like.numel() == 0 and q.like.shape == (*shape, 0)
    y = dequantize_blockwise(q, bits=bits)
    assert y.shape == x.shape and y.dtype == torch.float32


def test_dequantizing_as_another_shape_is_refused():
    q = quantize_blockwise(torch.randn(64, 128))
    with pytest.raises(
        ValueError, match=r"quantized array of shape \(64, 128\) cannot be dequantized as shape \(128, 64\)"
    ):
        dequantize_blockwise(q, (128, 64))


def test_bad_bits():
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        quantize_blockwise(torch.zeros(4), bits=3)
