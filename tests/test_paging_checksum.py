"""The paged state's checksum (``fadam.paging._checksum``): its definition, the compiled sums against torch ops on
any number of threads, and the changes it catches."""

import pytest
import torch

from fadam.paging import _checksum
from fadam.paging._storage import LeafPlace

MASK = (1 << 64) - 1


def _definition(data: bytes) -> tuple[int, ...]:
    """``s1`` and ``s2`` as the module's docstring defines them, in Python integers."""
    padded = data + bytes(-len(data) % 64)
    words = [int.from_bytes(padded[i : i + 8], "little") for i in range(0, len(padded), 8)]
    rows = len(words) // 8
    s1 = [sum(words[r * 8 + lane] for r in range(rows)) & MASK for lane in range(8)]
    s2 = [sum((rows - r) * words[r * 8 + lane] for r in range(rows)) & MASK for lane in range(8)]
    return (*s1, *s2)


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n", [0, 5, 64, 100, 1000])
def test_the_sums_are_their_definition(n):
    data = _bytes(n)
    assert _checksum.leaf_sums(data) == _definition(bytes(data.tolist()))
    assert _checksum._torch_sums(data) == _definition(bytes(data.tolist()))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_compiled_sums_on_several_threads_equal_torch_ops(threads, monkeypatch):
    monkeypatch.setattr(_checksum, "_SERIAL_BELOW", 0)  # every size on every thread
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n in (7, 64 * 3, (1 << 20) + 13):
            data = _bytes(n, seed=n)
            assert _checksum.leaf_sums(data) == _checksum._torch_sums(data), n
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_sums_of_many_spans_in_one_call_are_each_spans_own(threads, monkeypatch):
    monkeypatch.setattr(_checksum, "_SERIAL_BELOW", 1000)  # the large span on every thread
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        data = _bytes(20_000, seed=3)
        spans = [(0, 5), (64, 1000), (1088, 0), (1088, 15_000), (16_128, 7)]
        expected = [_checksum.leaf_sums(data[offset : offset + nbytes]) for offset, nbytes in spans]
        assert [_checksum._NATIVE_SUMS.unpack(sums) for sums in _checksum.spans_sums(data, spans)] == expected
    finally:
        torch.set_num_threads(before)


def test_a_changed_word_moved_rows_and_a_zeroed_page_change_the_checksum():
    data = _bytes(3 * 4096, seed=1)
    reference = _checksum.leaf_sums(data)
    changed = data.clone()
    changed[5000] ^= 1
    swapped = data.clone()
    swapped[64:128], swapped[128:192] = data[128:192], data[64:128]  # two rows: their lanes' sums stay
    zeroed = data.clone()
    zeroed[4096:8192] = 0
    for other in (changed, swapped, zeroed):
        assert _checksum.leaf_sums(other) != reference


def test_a_chunks_checksum_reads_its_leaves_in_order_and_not_the_padding():
    buffer = _bytes(512, seed=2)
    places = [LeafPlace(0, 0, 100, (25,), torch.float32), LeafPlace(1, 128, 200, (200,), torch.uint8)]
    expected = _checksum.ChunkChecksum()
    expected.add(buffer[0:100])
    expected.add(buffer[128:328])
    padded_elsewhere = buffer.clone()
    padded_elsewhere[100:128] = 7
    assert _checksum.ChunkChecksum.of_leaves(padded_elsewhere, _checksum.Spans.of(places)).value == expected.value
    reversed_order = _checksum.ChunkChecksum()
    reversed_order.add(buffer[128:328])
    reversed_order.add(buffer[0:100])
    assert reversed_order.value != expected.value
    assert _checksum.ChunkChecksum().value == 0  # a chunk of no bytes
