"""Bit layouts: pack then unpack gives back the same bits, and the layouts are the documented ones."""

import pytest
import torch

from qkiln.quant.pack import AWQ_ORDER, pack_int4, pack_int32, unpack_int4, unpack_int32


def _unsigned(*shape, bits=4):
    return torch.randint(0, 1 << bits, shape, dtype=torch.uint8)


def _signed(*shape):
    return torch.randint(-8, 8, shape, dtype=torch.int8)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_int4_pairs_round_trip_bit_exact(dim):
    q = _unsigned(8, 6, 10)
    packed = pack_int4(q, dim=dim)
    assert packed.dtype == torch.uint8
    assert packed.shape[dim] == q.shape[dim] // 2
    assert torch.equal(unpack_int4(packed, dim=dim), q)


def test_int4_signed_round_trip_and_twos_complement():
    q = _signed(5, 16)
    packed = pack_int4(q)
    assert torch.equal(unpack_int4(packed, signed=True), q)
    assert torch.equal(unpack_int4(packed, signed=False), (q.to(torch.int16) & 0xF).to(torch.uint8))
    assert int(pack_int4(torch.tensor([[-1, 7]], dtype=torch.int8))[0, 0]) == 0x7F


def test_int4_low_nibble_holds_even_index():
    packed = pack_int4(torch.tensor([[3, 12, 0, 15]], dtype=torch.uint8))
    assert packed.tolist() == [[3 | 12 << 4, 0 | 15 << 4]]


@pytest.mark.parametrize("order", ["gptq", "awq"])
@pytest.mark.parametrize("dim", [0, -1])
def test_int32_words_round_trip_bit_exact(order, dim):
    q = _unsigned(16, 24)
    words = pack_int32(q, dim=dim, order=order)
    assert words.dtype == torch.int32
    assert words.shape[dim] == q.shape[dim] // 8
    assert torch.equal(unpack_int32(words, dim=dim, order=order), q)


def test_int32_eight_bit_and_signed_round_trip():
    q8 = _unsigned(4, 12, bits=8)
    assert torch.equal(unpack_int32(pack_int32(q8, num_bits=8), num_bits=8), q8)
    qs = _signed(3, 16)
    assert torch.equal(unpack_int32(pack_int32(qs), signed=True), qs)


def test_int32_layouts_match_gptq_and_awq():
    codes = list(range(8))
    q = torch.tensor([codes], dtype=torch.uint8)
    gptq_word = sum(c << (4 * j) for j, c in enumerate(codes))
    awq_word = sum(codes[AWQ_ORDER[j]] << (4 * j) for j in range(8))
    assert int(pack_int32(q, order="gptq")) == gptq_word - (1 << 32 if gptq_word >= 1 << 31 else 0)
    assert int(pack_int32(q, order="awq")) == awq_word - (1 << 32 if awq_word >= 1 << 31 else 0)
    top = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 15]], dtype=torch.uint8)
    assert int(pack_int32(top)) < 0  # the sign bit is a code bit, not an overflow
    assert torch.equal(unpack_int32(pack_int32(top)), top)


def test_pack_rejects_out_of_range_codes_and_odd_sizes():
    with pytest.raises(ValueError):
        pack_int4(torch.tensor([[16, 0]], dtype=torch.uint8))
    with pytest.raises(ValueError):
        pack_int4(torch.tensor([[8, 0]], dtype=torch.int8))
    with pytest.raises(ValueError):
        pack_int4(_unsigned(2, 3))
    with pytest.raises(ValueError):
        pack_int32(_unsigned(2, 12))
