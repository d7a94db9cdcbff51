import pytest
import torch

from fadam.quantization._codec import encode
from fadam.quantization._maps import MAP_IDS, code_maps, dynamic_map, encode_tables, linear_nonzero_map

LENGTHS = {"dynamic8_signed": 255, "dynamic8_unsigned": 256, "dynamic4_signed": 15, "linear4_nonzero": 16}


def test_dynamic_maps_shape_and_range():
    signed, unsigned, signed4 = dynamic_map(True, 8), dynamic_map(False, 8), dynamic_map(True, 4)
    assert (signed.numel(), unsigned.numel(), signed4.numel()) == (255, 256, 15)
    for m in (signed, unsigned, signed4):
        assert bool((m[1:] > m[:-1]).all())  # sorted, distinct
        assert m.max().item() == 1.0 and bool((m == 0).any())
    assert torch.equal(signed, -signed.flip(0))  # symmetric
    assert unsigned.min().item() == 0.0 and unsigned[1].item() == pytest.approx(1e-7)
    # unsigned has twice the points of the signed map in its top decade
    assert int(((unsigned > 0.1) & (unsigned <= 1)).sum()) == 2 * int(((signed > 0.1) & (signed <= 1)).sum())
    assert signed[signed > 0].min().item() == pytest.approx(1e-6)


def test_linear_nonzero_map_has_no_zero():
    m = linear_nonzero_map(4)
    assert m.numel() == 16 and m.min().item() == 1 / 16 and m.max().item() == 1.0


def _nearest_by_search(y, name):
    values = code_maps()[MAP_IDS[name], : LENGTHS[name]]
    return torch.bucketize(y, (values[:-1] + values[1:]) / 2)


@pytest.mark.parametrize("name", list(MAP_IDS))
def test_table_encoder_is_exact_nearest(name):
    torch.manual_seed(0)
    values = code_maps()[MAP_IDS[name], : LENGTHS[name]]
    mids = (values[:-1] + values[1:]) / 2
    lo = -1.0 if "signed" in name and "unsigned" not in name else 0.0
    samples = [
        torch.rand(20000) * (1 - lo) + lo,
        torch.sign(torch.randn(20000)) * 10 ** (-9 * torch.rand(20000)),  # every decade
        mids,
        torch.nextafter(mids, torch.tensor(2.0)),
        torch.nextafter(mids, torch.tensor(-2.0)),
        values,
        torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30]),
    ]
    y = torch.cat(samples).clamp(lo, 1.0)
    codes = encode(y, torch.tensor(MAP_IDS[name], dtype=torch.uint8))
    assert torch.equal(codes, _nearest_by_search(y, name))


def test_tables_are_cached_per_device():
    assert encode_tables("cpu")[0] is encode_tables(torch.device("cpu"))[0]
