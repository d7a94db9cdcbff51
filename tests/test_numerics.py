"""fadam._numerics: the saturating step counter, bias corrections, host numbers and the record of zero-free tensors."""

from __future__ import annotations

import torch

from fadam._numerics import (
    bias_correction,
    bias_correction_number,
    host_number,
    safe_increment,
    zero_count,
)

INT32_MAX = torch.iinfo(torch.int32).max


def test_safe_increment_counts_and_saturates_on_every_path() -> None:
    one = safe_increment(zero_count())
    assert one.dtype == torch.int32 and one.device.type == "cpu" and one.dim() == 0 and int(one) == 1
    top = torch.tensor(INT32_MAX, dtype=torch.int32)
    assert int(safe_increment(top)) == INT32_MAX  # does not wrap to the int32 minimum
    assert int(safe_increment(top - 1)) == INT32_MAX
    # per-member counts under vmap take the tensor path and give the same numbers
    counts = torch.tensor([0, INT32_MAX - 1, INT32_MAX], dtype=torch.int32)
    stepped = torch.func.vmap(safe_increment)(counts)
    assert stepped.dtype == torch.int32 and stepped.tolist() == [1, INT32_MAX, INT32_MAX]


def test_bias_correction_of_a_plain_count_is_the_tensor_formula_bit_for_bit() -> None:
    # A plain count takes Python's pow, as torch.optim does; fadam computed torch.pow of the 0-d count in float64
    # before, which calls the same C pow. Every count of a run must agree with it exactly.
    counts = [*range(5001), 123_456, 10**7, INT32_MAX]
    for decay in (0.9, 0.99, 0.999, 0.9999, 0.5, 0.0, 1.0):
        for count in counts:
            count = torch.tensor(count, dtype=torch.int32)
            expected = (1 - torch.pow(decay, count.to(torch.float64))).item()
            assert bias_correction_number(decay, count) == expected, (decay, count)
        plain = bias_correction(decay, count)
        assert plain.dtype == torch.float64 and plain.dim() == 0 and plain.item() == expected
    top = torch.tensor(INT32_MAX, dtype=torch.int32)
    assert bias_correction_number(torch.tensor(0.9), top) is None  # a tensor decay: the tensor formula
    assert bias_correction_number(0.9, torch.ones(2, dtype=torch.int32)) is None  # not a 0-d count
    assert bias_correction_number(3.0, top) is None  # overflows a float: torch.pow's inf
    assert bias_correction(3.0, top).item() == float("-inf")
    # per-member counts (vmap) take torch.pow's vector code, which may differ in the last bit
    batched = torch.func.vmap(lambda c: bias_correction(0.9, c))(torch.arange(30, dtype=torch.int32))
    expected = torch.tensor([1 - 0.9**k for k in range(30)], dtype=torch.float64)
    torch.testing.assert_close(batched, expected, rtol=1e-15, atol=0)


def test_host_number_reads_only_plain_cpu_scalars_outside_autograd() -> None:
    value = torch.tensor(0.25, dtype=torch.float64)
    assert host_number(value) == 0.25 and isinstance(host_number(value), float)
    assert host_number(1.5) == 1.5 and host_number(None) is None
    for kept in (
        torch.tensor(0.5, requires_grad=True),  # would leave the graph
        torch.tensor([0.5]),  # not 0-d
        torch.nn.Parameter(torch.tensor(0.5), requires_grad=False),  # a subclass
    ):
        assert host_number(kept) is kept
    batched = torch.func.vmap(lambda x: torch.as_tensor(isinstance(host_number(x), torch.Tensor)))(torch.ones(2))
    assert batched.all()  # a vmapped value stays a tensor (reading it would fail)
