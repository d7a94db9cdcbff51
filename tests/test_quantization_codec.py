import pytest
import torch
from torch.func import vmap

from fadam.quantization import dequantize_blockwise, dynamic_map, quantize_blockwise
from fadam.quantization._codec import expected_sizes
from fadam.quantization._maps import MAP_IDS, encode, tables_on


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


def test_non_finite_entries_do_not_set_the_scale():
    torch.manual_seed(0)
    x = torch.randn(512)
    bad = x.clone()
    bad[3], bad[300], bad[301] = float("inf"), float("nan"), float("-inf")
    q, y = roundtrip(bad)
    finite = torch.isfinite(bad)
    assert torch.isfinite(q.absmax).all()
    assert q.absmax[0] == x[:256][finite[:256]].abs().max()
    assert y[3] == q.absmax[0] and y[300] == 0 and y[301] == -q.absmax[1]
    _, y_clean = roundtrip(torch.where(finite, bad, 0.0))
    assert torch.equal(y[finite], y_clean[finite])


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
    y = vmap(lambda c, a, i: dequantize_blockwise(type(q)(c, a, i), (1000,), bits, 128))(*q)
    for k in range(3):
        qk = quantize_blockwise(stacked[k], bits, 128)
        assert torch.equal(q.codes[k], qk.codes) and torch.equal(q.absmax[k], qk.absmax)
        assert torch.equal(q.map_id[k], qk.map_id)
        assert torch.equal(y[k], dequantize_blockwise(qk, (1000,), bits, 128))


def test_bad_bits():
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        quantize_blockwise(torch.zeros(4), bits=3)
